"""Why two rows of ``torch_default.py``'s table miss, on one GPU.

transformer  speed: the plain eager step's wall time against the GPU time of its kernels
             (torch.profiler over STEPS steps): a replayed graph can remove the host's
             gaps, never the kernels. exactness (TF32 off, cuDNN deterministic,
             CUBLAS_WORKSPACE_CONFIG set by the caller): Keras's eager step against kmgpu's
             split step run eagerly on the GPU and against the captured one, 6 steps.
EfficientNetB0  which tensors of the graphs' memory pool are still allocated after
             ``close()``, with where they were allocated (torch's memory history).

    KERAS_BACKEND=torch CUBLAS_WORKSPACE_CONFIG=:4096:8 python benchmarks/torch_default_why.py --out DIR
"""

import argparse
import contextlib
import io
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_default as td  # noqa: E402

OUT = {}


def transformer(steps, quick):
    import torch

    import kmgpu
    from kmgpu.bench import workloads
    from kmgpu.engines.torch.capture import graphs

    w = workloads.get("transformer", quick=quick, devices=1, steps=10)
    model = w.build()
    init = model.get_weights()
    x, y = w.data()
    model.compile(**w.compile_args())
    model.fit(x, y, batch_size=w.batch, epochs=1, shuffle=False, verbose=0)  # warm
    acts = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if td.cuda() else [])
    n = steps * w.batch
    td.sync()
    start = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        model.fit(x[:n], y[:n], batch_size=w.batch, epochs=1, shuffle=False, verbose=0)
        td.sync()
    wall = (time.perf_counter() - start) / steps
    kernels = sum(e.self_device_time_total for e in prof.key_averages()
                  if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6 / steps
    OUT["transformer_step"] = {"wall_ms_profiled": wall * 1e3, "gpu_kernel_ms": kernels * 1e3,
                               "top": prof.key_averages().table(
                                   sort_by="self_device_time_total" if td.cuda()
                                   else "self_cpu_time_total", row_limit=12)}
    td.log(f"transformer step: wall {wall * 1e3:.1f} ms (profiled), kernels {kernels * 1e3:.1f} ms")

    weights = {}
    p = 6 * w.batch
    with td.exact():
        for how in ("keras", "split eager", "captured"):
            model.set_weights(init)
            if how == "keras":
                runner = model
                model.compile(**w.compile_args())
            else:
                runner = kmgpu.parallelize(model, gpus=1)
                runner.compile(**w.compile_args(), jit_compile=how == "split eager")
            if how == "split eager":  # the split step, never captured
                graphs.CapturedStep.may_capture = lambda self, kind: False
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    runner.fit(x[:p], y[:p], batch_size=w.batch, epochs=1, shuffle=False,
                               verbose=0)
            finally:
                graphs.CapturedStep.may_capture = _MAY_CAPTURE
            weights[how] = model.get_weights()
            if runner is not model:
                runner.close()
    names = [v.path for v in model.weights]
    diffs = {}
    for a, b in (("keras", "split eager"), ("keras", "captured"), ("split eager", "captured")):
        per = [(td.rel_diff([u], [v]), name) for u, v, name in
               zip(weights[a], weights[b], names)]
        diffs[f"{a} vs {b}"] = {"max": max(per)[0], "worst": sorted(per)[-3:]}
    OUT["transformer_exactness"] = diffs
    td.log(f"transformer exactness: {json.dumps(diffs, default=str)}")


_MAY_CAPTURE = None


def leftover(quick):
    import keras
    import torch

    import kmgpu
    from kmgpu.engines.torch.capture import graphs

    if not td.cuda():
        OUT["leftover"] = "no CUDA device"
        return
    torch.cuda.memory._record_memory_history(max_entries=200000)
    image = 32 if quick else 128
    model = keras.applications.EfficientNetB0(weights=None, input_shape=(image, image, 3),
                                              classes=10, classifier_activation=None)
    x, y = td.image_data(640, image)
    parallel = kmgpu.parallelize(model, gpus=1)
    parallel.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    parallel.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    pools = {tuple(p) for p in parallel._engine._step.pools}
    parallel.close()
    snap = torch.cuda.memory._snapshot()
    left = []
    for seg in snap["segments"]:
        if tuple(seg.get("segment_pool_id") or ()) not in pools:
            continue
        for block in seg["blocks"]:
            if block["state"] == "active_allocated":
                frames = [f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}"
                          for f in block.get("frames", []) if ".py" in f["filename"]][:8]
                left.append({"bytes": block["size"], "frames": frames})
    torch.cuda.memory._record_memory_history(enabled=None)
    OUT["leftover"] = {"pool_bytes_after_close": graphs.pool_bytes(list(pools)),
                       "blocks": sorted(left, key=lambda b: -b["bytes"])[:6]}
    td.log(f"leftover: {json.dumps(OUT['leftover'])[:3000]}")


def main():
    global _MAY_CAPTURE
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    from kmgpu.engines.torch.capture import graphs

    _MAY_CAPTURE = graphs.CapturedStep.may_capture
    for fn in (lambda: transformer(3 if args.quick else 5, args.quick),
               lambda: leftover(args.quick)):
        try:
            fn()
        except Exception:
            import traceback

            OUT.setdefault("errors", []).append(traceback.format_exc()[-1500:])
            print(OUT["errors"][-1])
        with open(os.path.join(args.out, "why.json"), "w") as f:
            json.dump(OUT, f, indent=1, default=str)


if __name__ == "__main__":
    main()
