"""What JAX's persistent compilation cache does in a bench worker: switched on for every
program before the process's first compile, and read back run by run (programs loaded,
programs compiled, the train step's cache key part by part, entries not written or not
read and why) from JAX's own log messages and warnings."""

import re


def share_compiled_code(folder):
    """JAX's persistent compilation cache for every program, so runs that compile the
    same program (plain fit, kmgpu on one device and plain fit again; kmgpu and the
    peer) compile and autotune it once and run the same kernels: separate compiles can
    pick different kernels, a difference between runs that is not kmgpu's. The
    first epoch of a later run in the process then is no compile time (marked: it had
    runs before it)."""
    import jax

    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    LOG.attach()


class CompileLog:
    """What JAX's persistent compilation cache did during a run, read from the messages
    of JAX's compiler and cache-key loggers: the programs loaded from the cache (hits) and
    those compiled, with each compile's seconds, and the train step's cache key part by
    part (the program, XLA flags, compile options, ...). It says whether a later run in
    the process loaded plain fit's programs or compiled its own, and where a key
    differs, which part made it differ."""

    LOGGERS = ("jax._src.compiler", "jax._src.cache_key")
    PART = re.compile(r"get_cache_key hash of serialized (.+): ([0-9a-f]+)")
    NOT_WRITTEN = re.compile(r"Not writing persistent cache entry.*")
    ERROR = r"Error (reading|writing) persistent compilation cache entry"
    HIT = re.compile(r"[Pp]ersistent compilation cache hit for '([^']+)'")
    MISS = re.compile(r"PERSISTENT COMPILATION CACHE MISS for '([^']+)'")
    TOOK = re.compile(r"'([^']+)' took at least .* to compile \(([0-9.]+)s\)")

    def __init__(self):
        self.attached = False
        self.clear()

    def clear(self):
        self.hits, self.misses, self.compiled = [], [], []
        self.parts, self.train_key, self.trouble = {}, {}, []

    def attach(self):
        """Read JAX's loggers, and its warnings that a cache entry could not be read or
        written (shown even where the worker ignores warnings). Once per process: a
        second handler would count every message twice."""
        import logging
        import warnings

        if self.attached:
            return
        self.attached = True

        warnings.filterwarnings("always", message=self.ERROR)
        shown = warnings.showwarning

        def show(message, *args, **kwargs):
            if re.match(self.ERROR, str(message)):
                self.trouble.append(str(message)[:300])
            shown(message, *args, **kwargs)

        warnings.showwarning = show

        class Handler(logging.Handler):
            def emit(handler, record):
                self.read(record.getMessage())

        for name in self.LOGGERS:
            logger = logging.getLogger(name)
            logger.setLevel(logging.DEBUG)
            logger.addHandler(Handler(logging.DEBUG))
            logger.propagate = False  # its DEBUG lines stay out of the worker's log

    def read(self, message):
        part = self.PART.search(message)
        if part:  # the key's parts come before the hit or miss of its program
            self.parts[part.group(1)] = part.group(2)[:12]
            return
        hit, miss = self.HIT.search(message), self.MISS.search(message)
        took, not_written = self.TOOK.search(message), self.NOT_WRITTEN.search(message)
        if not_written:  # e.g. a program with host callbacks is never written
            self.trouble.append(not_written.group(0)[:300])
        elif hit or miss:
            name = (hit or miss).group(1)
            (self.hits if hit else self.misses).append(name)
            if "train_step" in name:
                self.train_key = self.parts
            self.parts = {}
        elif took:
            self.compiled.append((took.group(1), float(took.group(2))))

    def take(self):
        """{"cache_hits": n, "cache_misses": n, "compile_s": seconds, "compiled":
        [[name, seconds], ...] of the compiles over 0.1 s, "train_step_key": {part:
        hash}, "cache_trouble": [why an entry was not read or written, ...]} since the
        last take, or {} where nothing was logged."""
        taken = {"cache_hits": len(self.hits), "cache_misses": len(self.misses),
                 "compile_s": sum(s for _, s in self.compiled),
                 "compiled": [[name, s] for name, s in self.compiled if s > 0.1],
                 "train_step_key": self.train_key, "cache_trouble": self.trouble}
        logged = self.hits or self.misses or self.compiled or self.trouble
        self.clear()
        return taken if logged else {}


LOG = CompileLog()  # the process's one reader of JAX's loggers
