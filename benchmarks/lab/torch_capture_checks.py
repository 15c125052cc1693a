"""kmgpu's captured torch path on one GPU: every fallback, forced, and parity with plain Keras.

check (``--part check``): every fallback kmgpu has, forced on CUDA, each followed by
  torch's CUDA state (current stream, an eager dropout through the default generator)
  and a plain Keras model with Dropout fit in the same process; mixed_float16; parity
  with plain Keras (TF32 off both sides): fit with validation_data / validation_split /
  validation_freq, evaluate, predict (last partial batch), mixed_float16 + gradient
  accumulation + AUC; every Keras metric class, captured and equal to plain Keras; a
  shuffled fit under a global seed in plain Keras's order.
ranks (``--part ranks``, under torchrun): this process is one rank of a distributed job,
  so evaluate, predict and fit's validation run the rank's captured test and predict
  steps; numbers against plain Keras in the same process (TF32 off both sides).

    KERAS_BACKEND=torch python benchmarks/lab/torch_capture_checks.py --part check --out /tmp/w
    KERAS_BACKEND=torch torchrun --nproc_per_node=1 benchmarks/lab/torch_capture_checks.py --part ranks

The speed table of the same path: ``torch_whole_run.py``.
"""

import argparse
import contextlib
import io
import json
import os
import sys
import time
import traceback

import numpy as np

# the weights measure and the CUDA probe of torch_default.py (the same script family)
from torch_default import cuda, rel_diff

T0 = time.perf_counter()
OUT = {"checks": {}}


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def state():
    if not cuda():
        return {}
    from kmgpu.engines.torch.capture import cuda_graphs

    return cuda_graphs.state()


def plain_dropout_fit():
    """A plain Keras model with Dropout, no kmgpu: 'ok' or the error."""
    import keras

    try:
        m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
                              keras.layers.Dropout(0.5), keras.layers.Dense(1)])
        m.compile(optimizer="adam", loss="mse")
        x = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
        m.fit(x, x[:, :1], batch_size=16, epochs=1, verbose=0)
        return "ok"
    except Exception as e:  # a failed capture
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def quiet(fn):
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        out = fn()
    return out, [ln for ln in text.getvalue().splitlines() if "kmgpu (torch)" in ln]


# -- checks -------------------------------------------------------------------------------
def host_read_model(where):
    """An MLP whose call reads a tensor on the host ``where``: "train" (graph A
    fails), "infer" (test/predict captures fail); a metric that reads on the host for
    graph B ("metric")."""
    import keras

    class Reads(keras.layers.Layer):
        def call(self, x, training=False):
            if (where == "train" and training) or (where == "infer" and not training):
                if float(keras.ops.sum(x)) > 1e30:  # a host read, never true
                    x = x * 2.0
            return x

    class Metric(keras.metrics.Mean):
        def update_state(self, y_true, y_pred, sample_weight=None):
            v = keras.ops.mean(y_pred)
            if float(v) > 1e30:
                v = v * 2.0
            return super().update_state(v)

    keras.utils.set_random_seed(2)
    m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                          Reads(), keras.layers.Dense(1)])
    m.compile(optimizer="adam", loss="mse",
              metrics=[Metric(name="m")] if where == "metric" else ["mae"])
    return m


def one_fallback(name, build, policy="float32"):
    import keras

    import kmgpu

    keras.mixed_precision.set_global_policy(policy)
    try:
        x = np.random.default_rng(1).normal(size=(400, 8)).astype("float32")
        y = x[:, :1] * 2.0
        model = build()
        init = model.get_weights()
        ref = build()
        ref.set_weights(init)
        ref.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0,
                validation_data=(x[:100], y[:100]))
        ref_pred = ref.predict(x[:77], batch_size=16, verbose=0)
        before = state()
        parallel = kmgpu.parallelize(model, gpus=1)
        (_, printed) = quiet(lambda: parallel.fit(x, y, batch_size=32, epochs=2, shuffle=False,
                                                  verbose=0, validation_data=(x[:100], y[:100])))
        pred, printed2 = quiet(lambda: parallel.predict(x[:77], batch_size=16, verbose=0))
        ev, printed3 = quiet(lambda: parallel.evaluate(x[:100], y[:100], batch_size=16,
                                                       verbose=0))
        after = state()
        res = {"printed": printed + printed2 + printed3,
               "weights_vs_plain": rel_diff(ref.get_weights(), model.get_weights()),
               "predict_vs_plain": rel_diff([ref_pred], [pred]), "pred_rows": len(pred),
               "state_before": before, "state_after": after,
               "describe": parallel.describe().splitlines()[-3:]}
        parallel.close()
    finally:
        keras.mixed_precision.set_global_policy("float32")
    res["plain_dropout_fit_after"] = plain_dropout_fit()
    OUT["checks"][name] = res
    log(name, json.dumps(res)[:900])


def replay_failure(build):
    """Every replay raises once it ran once: train, test and predict fall back to eager."""
    from kmgpu.engines.torch.capture import graphs

    real = graphs.capture

    def capture(fn, pool=None):
        graph, out = real(fn, pool)

        class Failing:
            n = 0

            def pool(self):
                return graph.pool()

            def replay(self):
                Failing.n += 1
                if Failing.n > 1:
                    raise RuntimeError("simulated replay failure")
                graph.replay()

        return Failing(), out

    graphs.capture = capture
    try:
        one_fallback("replay fails", build)
    finally:
        graphs.capture = real


def parity(quick):
    """kmgpu vs plain Keras, TF32 off on both sides (kmgpu: tf32=False)."""
    import keras
    import torch

    import kmgpu

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True

    def build():
        keras.utils.set_random_seed(5)
        i = keras.Input((16, 16, 3))
        h = keras.layers.Conv2D(16, 3, padding="same", use_bias=False)(i)
        h = keras.layers.BatchNormalization()(h)
        h = keras.layers.Activation("relu")(h)
        h = keras.layers.GlobalAveragePooling2D()(h)
        o = keras.layers.Dense(1, activation="sigmoid")(h)
        m = keras.Model(i, o)
        m.compile(optimizer="adam", loss="binary_crossentropy",
                  metrics=["accuracy", keras.metrics.AUC(), keras.metrics.BinaryIoU()])
        return m

    rng = np.random.default_rng(3)
    x = rng.normal(size=(1000, 16, 16, 3)).astype("float32")
    y = (x.mean(axis=(1, 2, 3)) > 0).astype("float32")[:, None]
    xv, yv = x[:333], y[:333]
    kw = dict(batch_size=64, epochs=3, shuffle=False, verbose=0)
    for name, fit_kw in [("validation_data freq 2", dict(validation_data=(xv, yv),
                                                         validation_freq=2)),
                         ("validation_split 0.2", dict(validation_split=0.2))]:
        ref = build()
        init = ref.get_weights()
        h_ref = ref.fit(x, y, **kw, **fit_kw).history
        model = build()
        model.set_weights(init)
        parallel = kmgpu.parallelize(model, gpus=1, tf32=False)
        h, printed = quiet(lambda: parallel.fit(x, y, **kw, **fit_kw).history)
        e_ref = ref.evaluate(xv, yv, batch_size=50, verbose=0)
        (e, p), printed2 = quiet(lambda: (parallel.evaluate(xv, yv, batch_size=50, verbose=0),
                                          parallel.predict(xv, batch_size=50, verbose=0)))
        p_ref = ref.predict(xv, batch_size=50, verbose=0)
        eng = parallel._engine
        OUT["checks"]["parity " + name] = {
            "weights": rel_diff(ref.get_weights(), model.get_weights()),
            "history": {k: rel_diff([a], [b]) for (k, a), b in zip(h_ref.items(), h.values())},
            "evaluate": rel_diff([e_ref], [e]), "predict": rel_diff([p_ref], [p]),
            "predict_rows": [len(p_ref), len(p)],
            "graphs": {"train": len(eng._step.graphs) if eng._step else 0,
                       "eval": len(eng._eval.graphs) if eng._eval else 0},
            "printed": printed + printed2}
        log(name, OUT["checks"]["parity " + name])
        parallel.close()
    torch.backends.cudnn.deterministic = False


def mixed_parity():
    """mixed_float16 (LossScaleOptimizer) + gradient accumulation + AUC: graph B whole."""
    import keras
    import torch

    import kmgpu

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        def build():
            keras.utils.set_random_seed(6)
            m = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(1, activation="sigmoid", dtype="float32")])
            m.compile(optimizer=keras.optimizers.Adam(gradient_accumulation_steps=2),
                      loss="binary_crossentropy", metrics=[keras.metrics.AUC()])
            return m

        rng = np.random.default_rng(4)
        x = rng.normal(size=(2048, 32)).astype("float32")
        y = (x[:, :1] > 0).astype("float32")
        ref = build()
        init = ref.get_weights()
        ref.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
        model = build()
        model.set_weights(init)
        parallel = kmgpu.parallelize(model, gpus=1, tf32=False)
        _, printed = quiet(lambda: parallel.fit(x, y, batch_size=64, epochs=2, shuffle=False,
                                                verbose=0))
        OUT["checks"]["mixed_float16 + accumulation + AUC"] = {
            "weights": rel_diff(ref.get_weights(), model.get_weights()),
            "scale": [float(ref.optimizer.dynamic_scale.numpy()),
                      float(model.optimizer.dynamic_scale.numpy())],
            "printed": printed, "graph_b": getattr(parallel._engine._step, "capture_update", None)}
        parallel.close()
    finally:
        keras.mixed_precision.set_global_policy("float32")
    OUT["checks"]["mixed_float16 + accumulation + AUC"]["plain_dropout_fit_after"] = \
        plain_dropout_fit()
    log(OUT["checks"]["mixed_float16 + accumulation + AUC"])


def every_metric():
    """Every class keras.metrics exports (tests/torch/metric_cases.py, by kind; the binary
    ones under the hinge loss): fit, evaluate, predict under kmgpu's default against plain
    Keras (TF32 off both sides), nothing printed (graph B and the test step captured)."""
    import keras
    import torch

    import kmgpu

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from tests.torch.metric_cases import KINDS, _case

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False

    def flat(values):  # metrics' results: scalars, or arrays (F1Score: one per class)
        return [np.ravel(np.asarray(v, np.float64)) for v in values]

    def run(runner, x, y):
        h = runner.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0).history
        return (list(h.values()), runner.evaluate(x, y, batch_size=4, verbose=0),
                runner.predict(x, batch_size=4, verbose=0))

    for kind, loss in [("binary", "hinge"), ("onehot", None), ("sparse", None),
                       ("regression", None)]:
        build, x, y = _case(kind, loss)
        ref = run(build(), x, y)
        model = build()
        parallel = kmgpu.parallelize(model, gpus=1, tf32=False)
        got, printed = quiet(lambda: run(parallel, x, y))
        OUT["checks"]["every metric: " + kind] = res = {
            "metrics": len(KINDS[kind]), "printed": printed,
            "graph_b": getattr(parallel._engine._step, "capture_update", None),
            "history": rel_diff(flat(ref[0]), flat(got[0])),
            "evaluate": rel_diff(flat(ref[1]), flat(got[1])),
            "predict": rel_diff([ref[2]], [got[2]]), "rows": [len(ref[2]), len(got[2])]}
        parallel.close()
        log("every metric", kind, res)
    OUT["checks"]["every metric: binary"]["plain_dropout_fit_after"] = plain_dropout_fit()


def shuffled():
    """fit(shuffle=True / "batch") under a global seed on the one-device captured path (rows
    kept on the GPU): plain Keras's order (engines/torch/data/shuffle.py), TF32 off both sides;
    the generators left where plain Keras leaves them."""
    import random

    import keras
    import torch

    import kmgpu

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    rng = np.random.default_rng(8)
    x = rng.normal(size=(1000, 16)).astype("float32")
    y = x[:, :1] * 2.0 - x[:, 1:2]

    def build():
        keras.utils.set_random_seed(3)
        m = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(1)])
        m.compile(optimizer="adam", loss="mse")
        return m

    def script(runner):
        keras.utils.set_random_seed(7)
        runner.fit(x, y, batch_size=64, epochs=3, verbose=0, validation_data=(x[:200], y[:200]))
        runner.fit(x, y, batch_size=64, epochs=2, verbose=0, shuffle="batch")
        return torch.rand(3).tolist(), random.random()

    ref = build()
    draws_ref = script(ref)
    model = build()
    parallel = kmgpu.parallelize(model, gpus=1, tf32=False)
    draws, printed = quiet(lambda: script(parallel))
    OUT["checks"]["shuffled fit"] = res = {
        "weights": rel_diff(ref.get_weights(), model.get_weights()),
        "draws_equal": draws == draws_ref, "printed": printed,
        "graph_b": getattr(parallel._engine._step, "capture_update", None)}
    parallel.close()
    log("shuffled fit", res)


def ranks_check(quick):
    """One rank of a torchrun job (kmgpu's in-process launcher): fit with validation,
    evaluate, predict through the rank's steps, against plain Keras (TF32 off)."""
    import keras
    import torch

    import kmgpu

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True

    def build():
        keras.utils.set_random_seed(5)
        m = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(1, activation="sigmoid")])
        m.compile(optimizer="adam", loss="binary_crossentropy",
                  metrics=["accuracy", keras.metrics.AUC(), keras.metrics.BinaryIoU()])
        return m

    rng = np.random.default_rng(3)
    x = rng.normal(size=(1000, 32)).astype("float32")
    y = (x[:, :1] > 0).astype("float32")
    xv, yv = x[:333], y[:333]
    kw = dict(batch_size=64, epochs=3, shuffle=False, verbose=0, validation_data=(xv, yv))
    ref = build()
    init = ref.get_weights()
    h_ref = ref.fit(x, y, **kw).history
    e_ref = ref.evaluate(xv, yv, batch_size=50, verbose=0)
    p_ref = ref.predict(xv, batch_size=50, verbose=0)
    model = build()
    model.set_weights(init)
    parallel = kmgpu.parallelize(model, tf32=False)
    h, printed = quiet(lambda: parallel.fit(x, y, **kw).history)
    (e, p), printed2 = quiet(lambda: (parallel.evaluate(xv, yv, batch_size=50, verbose=0),
                                      parallel.predict(xv, batch_size=50, verbose=0)))
    evals = parallel._engine.launcher.strategy.evals
    OUT["checks"]["ranks"] = {
        "engine": parallel._engine.name,
        "weights": rel_diff(ref.get_weights(), model.get_weights()),
        "history": {k: rel_diff([a], [b]) for (k, a), b in zip(h_ref.items(), h.values())},
        "evaluate": rel_diff([np.ravel(e_ref)], [np.ravel(e)]), "predict": rel_diff([p_ref], [p]),
        "predict_rows": [len(p_ref), len(p)],
        "eval_graphs": sorted(str(k[0]) for k in evals.graphs) if evals else None,
        "printed": printed + printed2}
    log("ranks", OUT["checks"]["ranks"])


def checks(quick):
    if ARGS.part == "ranks":
        return ranks_check(quick)
    for name, fn in [
            ("graph A fails (host read in training call)", lambda: one_fallback(
                "graph A fails", lambda: host_read_model("train"))),
            ("graph B fails (host read in a metric)", lambda: one_fallback(
                "graph B fails", lambda: host_read_model("metric"))),
            ("test/predict captures fail (host read at inference)", lambda: one_fallback(
                "test and predict fail", lambda: host_read_model("infer"))),
            ("graph A fails under mixed_float16", lambda: one_fallback(
                "graph A fails, mixed_float16", lambda: host_read_model("train"),
                "mixed_float16")),
            ("mixed_float16 MLP", lambda: one_fallback(
                "mixed_float16 MLP", lambda: host_read_model("none"), "mixed_float16")),
            ("replays fail", lambda: replay_failure(lambda: host_read_model("none"))),
            ("parity", lambda: parity(quick)), ("mixed parity", mixed_parity),
            ("every metric", every_metric), ("shuffled fit", shuffled)]:
        if ARGS.checks and not any(c in name for c in ARGS.checks):
            continue
        try:
            fn()
        except Exception:
            OUT["checks"][name] = {"error": traceback.format_exc()[-1500:]}
            log(name, "ERROR", traceback.format_exc()[-1500:])


def main():
    global ARGS
    p = argparse.ArgumentParser()
    p.add_argument("--part", choices=["check", "ranks"], default="check")
    p.add_argument("--checks", nargs="*", help="substrings of check names")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default="/tmp/whole_run")
    ARGS = p.parse_args()
    import torch

    OUT["info"] = {"torch": torch.__version__, "cuda": cuda(),
                   "gpu": torch.cuda.get_device_name() if cuda() else None}
    checks(ARGS.quick)
    os.makedirs(ARGS.out, exist_ok=True)
    with open(os.path.join(ARGS.out, f"{ARGS.part}.json"), "w") as f:
        json.dump(OUT, f, indent=1, default=str)
    log("done")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
