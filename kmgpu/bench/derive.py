"""Figures worked out from the runs once they are all in: parity, speedup, efficiency,
kmgpu / peer and MFU. No backend needed (numpy for the parity only)."""

from kmgpu.bench import flops


def peer_name(backend):
    from kmgpu.bench.common import PEER_NAMES

    return PEER_NAMES[backend]


def index(results):
    """{(backend, workload, runner, devices, policy): run} of the runs that succeeded."""
    return {(r["backend"], r["workload"], r["runner"], r["devices"], r.get("policy", "global")): r
            for r in results["runs"] if r.get("status") == "ok"}


def workload_flops(results):
    """{(backend, workload): (FLOPs per sample, source)} from the run that counted them
    (plain fit; the reference counts its own)."""
    found = {}
    for r in results["runs"]:
        if r.get("status") == "ok" and r.get("flops_per_sample") and r["runner"] != "reference":
            found.setdefault((r["backend"], r["workload"]),
                             (r["flops_per_sample"], r.get("flops_source")))
    return found


def derive(results):
    """Add to each successful run: parity (against plain fit, where both saved weights),
    vs_plain (= speedup over plain fit on one device), efficiency (samples/s over N x the
    same runner's one-device samples/s; per_replica: its global one-device run, the same
    run; plain fit's where the runner has no one-device run), vs_peer (kmgpu over the peer at the same N and policy), flops_per_sample
    and mfu (where the GPU's peak is known)."""
    runs = index(results)
    counted = workload_flops(results)
    for (backend, workload, runner, n, policy), r in runs.items():
        if runner == "allreduce":
            continue
        plain = runs.get((backend, workload, "plain", 1, "global"))
        if plain and r.get("weights_file") and plain.get("weights_file"):
            import numpy as np

            a, b = np.load(plain["weights_file"]), np.load(r["weights_file"])
            r["parity"] = rel_diff([a[k] for k in sorted(a.files, key=_arr_index)],
                                   [b[k] for k in sorted(b.files, key=_arr_index)])
        one = (runs.get((backend, workload, runner, 1, policy))
               or runs.get((backend, workload, runner, 1, "global")) or plain)
        if one:
            r["efficiency"] = r["samples_per_s"] / (n * one["samples_per_s"])
        if plain:
            r["vs_plain"] = r["samples_per_s"] / plain["samples_per_s"]
        if runner == "kmgpu":
            peer = runs.get((backend, workload, "peer", n, policy))
            if peer:
                r["vs_peer"] = r["samples_per_s"] / peer["samples_per_s"]
        if runner != "reference" and (backend, workload) in counted:
            r["flops_per_sample"], r["flops_source"] = counted[(backend, workload)]
        r["mfu"] = flops.mfu(r.get("flops_per_sample"), r["samples_per_s"], n,
                             r.get("peak_flops"))


def _arr_index(key):
    return int(key.split("_")[-1])


def rel_diff(a_weights, b_weights):
    """Largest relative difference between two weight lists (max |a-b| / max |a|, per
    tensor), as ``rel_diff`` in tests/helpers.py."""
    import numpy as np

    if len(a_weights) != len(b_weights):
        return float("nan")
    worst = 0.0
    for a, b in zip(a_weights, b_weights):
        a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        if a.shape != b.shape:
            return float("nan")
        worst = max(worst, float(np.max(np.abs(a - b)) / max(np.max(np.abs(a)), 1e-12)))
    return worst
