"""The ``kmgpu`` command: ``kmgpu demo``, ``kmgpu bench``, ``kmgpu launch``.

Each subcommand lives in its own module with a ``main(argv)`` function; this file
only dispatches, so ``kmgpu --help`` imports no backend.
"""

import importlib
import sys

COMMANDS = {
    "demo": ("kmgpu.commands.demo", "the sine-wave LSTM on 1 device vs N devices: table + PNG"),
    "bench": ("kmgpu.bench", "throughput and scaling benchmarks, per backend"),
    "launch": ("kmgpu.commands.launch", "run a script on several processes or hosts"),
}


def main(argv=None):
    """Run ``kmgpu COMMAND [options]``: ``demo``, ``bench`` or ``launch``.

    Args:
        argv: the arguments after ``kmgpu`` (default: ``sys.argv[1:]``).

    Returns:
        The exit status: the subcommand's, or 2 for an unknown or missing command.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = [f"  {name:<7} {text}" for name, (_, text) in COMMANDS.items()]
        usage = ("usage: kmgpu {demo,bench,launch} [options]   (kmgpu COMMAND --help)\n"
                 + "\n".join(lines))
        if argv and argv[0] not in ("-h", "--help"):
            print(f"kmgpu: unknown command {argv[0]!r}\n{usage}", file=sys.stderr)
            return 2
        print(usage)
        return 0 if argv else 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
