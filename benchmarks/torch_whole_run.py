"""The whole torch run on kmgpu's captured path, on one GPU.

checks (``--part check``): every fallback kmgpu has, forced on CUDA, each followed by
  torch's CUDA state (current stream, an eager dropout through the default generator)
  and a plain Keras model with Dropout fit in the same process; mixed_float16 (the
  original failure); parity with plain Keras (TF32 off both sides): fit with
  validation_data / validation_split / validation_freq, evaluate, predict (last partial
  batch), mixed_float16 + gradient accumulation + AUC; every Keras metric class, captured
  and equal to plain Keras; a shuffled fit under a global seed in plain Keras's order.
table (``--part bench``): plain Keras against kmgpu's default, order-balanced in one
  process (plain, kmgpu, plain, kmgpu; the figure is the better of each side's two):
  fit without and with validation (samples/s, median epoch after the first), evaluate
  and predict (seconds, the median of calls after the first), under float32,
  mixed_float16 and mixed_bfloat16, for ResNet-50 64x64 (batch 256), a BERT-style
  encoder with Dropout in attention, and an LSTM.

set (``--part bench --set default``): the model set of torch_default.py (13
  keras.applications models at 128x128, batch 64, the bench's transformer and LSTM),
  float32 (``--only mixed_float16 mixed_bfloat16``: those rows), the same four runs each
  at a small size (``--budget`` seconds: the models left when it is spent are named in
  the JSON as not run).
ranks (``--part ranks``, under torchrun): this process is one rank of a distributed job,
  so evaluate, predict and fit's validation run the rank's captured test and predict
  steps; numbers against plain Keras in the same process (TF32 off both sides).

    KERAS_BACKEND=torch python benchmarks/torch_whole_run.py --part check --out /tmp/w
    KERAS_BACKEND=torch python benchmarks/torch_whole_run.py --part bench --quick --out /tmp/w
    KERAS_BACKEND=torch python benchmarks/torch_whole_run.py --part bench --set default --out /tmp/w
    KERAS_BACKEND=torch torchrun --nproc_per_node=1 benchmarks/torch_whole_run.py --part ranks
"""

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import time
import traceback

import numpy as np

# the weights measure and the CUDA probe of torch_default.py (the same script family)
from torch_default import cuda, rel_diff

T0 = time.perf_counter()
OUT = {"checks": {}, "bench": {}}


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

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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


# -- table --------------------------------------------------------------------------------
class EpochTimer:
    def __init__(self):
        import keras

        class T(keras.callbacks.Callback):
            def on_epoch_begin(s, epoch, logs=None):
                sync()
                s.t = time.perf_counter()

            def on_epoch_end(s, epoch, logs=None):
                sync()
                self.times.append(time.perf_counter() - s.t)

        self.times, self.callback = [], T()


def sync():
    if cuda():
        import torch

        torch.cuda.synchronize()


def resnet(image):
    import keras

    def build():
        keras.utils.set_random_seed(1)
        return keras.applications.ResNet50(weights=None, input_shape=(image, image, 3),
                                           classes=10, classifier_activation=None)

    def data(n, seed):
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((min(n, 256), image, image, 3), dtype=np.float32)
        return np.resize(x, (n, image, image, 3)), rng.integers(0, 10, n).astype("int32")

    return build, data, lambda: dict(optimizer="adam", metrics=["accuracy"], loss=keras.losses.
                                     SparseCategoricalCrossentropy(from_logits=True))


def bert(seq, vocab, d, heads, blocks):
    import keras

    def build():
        keras.utils.set_random_seed(1)
        i = keras.Input((seq,), dtype="int32")
        h = keras.layers.Embedding(vocab, d)(i)
        for _ in range(blocks):
            a = keras.layers.MultiHeadAttention(heads, d // heads, dropout=0.1)(h, h)
            h = keras.layers.LayerNormalization()(h + keras.layers.Dropout(0.1)(a))
            f = keras.layers.Dense(4 * d, activation="gelu")(h)
            f = keras.layers.Dropout(0.1)(keras.layers.Dense(d)(f))
            h = keras.layers.LayerNormalization()(h + f)
        o = keras.layers.Dense(2, dtype="float32")(keras.layers.GlobalAveragePooling1D()(h))
        return keras.Model(i, o)

    def data(n, seed):
        rng = np.random.default_rng(seed)
        return rng.integers(1, vocab, (n, seq)).astype("int32"), rng.integers(0, 2, n).astype(
            "int32")

    return build, data, lambda: dict(optimizer="adam", metrics=["accuracy"], loss=keras.losses.
                                     SparseCategoricalCrossentropy(from_logits=True))


def lstm(seq, units):
    import keras

    def build():
        keras.utils.set_random_seed(1)
        return keras.Sequential([keras.Input((seq, 16)), keras.layers.LSTM(units),
                                 keras.layers.Dense(1)])

    def data(n, seed):
        rng = np.random.default_rng(seed)
        x = rng.normal(size=(n, seq, 16)).astype("float32")
        return x, x.mean(axis=(1, 2))[:, None]

    return build, data, lambda: dict(optimizer="adam", loss="mse", metrics=["mae"])


def one_run(model, init, compile_args, train, val, batch, epochs, default, with_eval,
            tf32=True):
    import kmgpu

    model.set_weights(init)
    runner = kmgpu.parallelize(model, gpus=1, tf32=tf32) if default else model
    runner.compile(**compile_args())
    res = {}
    for key, kw in [("fit", {}), ("fit+val", {"validation_data": val})]:
        t = EpochTimer()
        _, printed = quiet(lambda: runner.fit(*train, batch_size=batch, epochs=epochs,
                                              shuffle=False, verbose=0, callbacks=[t.callback],
                                              **kw))
        res[key] = len(train[0]) / statistics.median(t.times[1:] or t.times)
        res.setdefault("printed", []).extend(printed)
    if with_eval:
        for key, fn in [("evaluate", lambda: runner.evaluate(*val, batch_size=batch, verbose=0)),
                        ("predict", lambda: runner.predict(val[0], batch_size=batch,
                                                           verbose=0))]:
            times = []
            for _ in range(2 if ARGS.set == "default" else 3):  # the first call not counted
                sync()
                t0 = time.perf_counter()
                quiet(fn)
                sync()
                times.append(time.perf_counter() - t0)
            res[key] = statistics.median(times[1:])
    if default:
        res["describe"] = [ln for ln in runner.describe().splitlines() if "step" in ln.lower()
                           or "float32" in ln][:3]
        runner.close()
    return res


def default_set(quick):
    """torch_default.py's models: {name: ((build, data, compile_args), batch, n, nv)};
    6 training and 3 validation batches each (2 and 2 with --quick)."""
    import keras
    from torch_default import applications, image_data

    from kmgpu.bench import workloads

    image, batch = (32, 8) if quick else (128, 64)
    k, kv = (2, 2) if quick else (6, 3)
    n, nv = k * batch, kv * batch  # the images' rows; the bench's workloads: their batch
    adam = lambda: dict(optimizer="adam", metrics=["accuracy"],  # noqa: E731
                        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    out = {}
    for wname in ("lstm", "transformer"):
        w = workloads.get(wname, quick=quick, devices=1, steps=k)
        out[f"{wname} (bench)"] = ((w.build, lambda rows, seed, w=w: tuple(
            a[:rows] for a in w.data()), w.compile_args), w.batch, k * w.batch, kv * w.batch)
    for name, build in applications(image).items():
        out[f"{name} {image}x{image}"] = ((build, lambda k, s: image_data(k, image, s), adam),
                                          batch, n, nv)
    return out


def bench(quick, only):
    import keras

    sizes = dict(n=4096, nv=2048, image=64, batch=256, epochs=3)
    if quick:
        sizes = dict(n=64, nv=40, image=32, batch=16, epochs=2)
    if ARGS.set == "default":
        sizes["epochs"] = 2
        models = {k: (v[0], v[1]) for k, v in default_set(quick).items()}
        rows = {k: (v[2], v[3]) for k, v in default_set(quick).items()}
        only = only or ["float32"]  # --only mixed_float16 mixed_bfloat16: those rows
    else:
        rows = {}
        models = self_models(sizes, quick)
    start = time.perf_counter()
    for name, ((build, data, compile_args), batch) in models.items():
        if ARGS.models and not any(m in name for m in ARGS.models):
            continue
        if time.perf_counter() - start > ARGS.budget:
            OUT["bench"].setdefault("not run (time budget)", []).append(name)
            continue
        for policy in ("float32", "mixed_float16", "mixed_bfloat16"):
            if only and policy not in only:
                continue
            key = f"{name} | {policy}"
            keras.mixed_precision.set_global_policy(policy)
            try:
                n, nv = rows.get(name, (sizes["n"], sizes["nv"]))
                if "BERT" in name:
                    n, nv = n // 2, nv // 2
                train, val = data(n, 0), data(nv, 1)
                model = build()
                init = model.get_weights()
                sides = ["plain", "kmgpu"]
                if policy == "float32" and "BERT" in name:
                    sides.append("kmgpu tf32=False")  # the other float32 policy
                runs = {side: [] for side in sides}
                for side in sides + sides:
                    runs[side].append(one_run(model, init, compile_args, train, val, batch,
                                              sizes["epochs"], side != "plain",
                                              with_eval=policy == "float32" or "ResNet" in name,
                                              tf32="tf32=False" not in side))
                OUT["bench"][key] = runs
                log(key, json.dumps(runs)[:1500])
            except Exception:
                OUT["bench"][key] = {"error": traceback.format_exc()[-1500:]}
                log(key, "ERROR", traceback.format_exc()[-1500:])
            finally:
                keras.mixed_precision.set_global_policy("float32")
            save(ARGS.out)


def self_models(sizes, quick):
    return {
        "ResNet50 64x64": (resnet(sizes["image"]), sizes["batch"]),
        "BERT-style encoder (dropout in attention)": (
            bert(128, 8000, 256, 4, 4) if not quick else bert(16, 100, 32, 2, 1),
            64 if not quick else 8),
        "LSTM": (lstm(64, 128) if not quick else lstm(8, 8), 256 if not quick else 16),
    }


def best(runs, key, fn=max):
    vals = [r[key] for r in runs if key in r]
    return fn(vals) if vals else None


def markdown():
    lines = ["| model | policy | fit plain | fit kmgpu | x | fit+val plain | fit+val kmgpu | x "
             "| x(val)/x | evaluate plain s | kmgpu s | x | predict plain s | kmgpu s | x |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, runs in OUT["bench"].items():
        if key.startswith("not run"):
            lines.append(f"| {key}: {', '.join(runs)} |" + " |" * 14)
            continue
        if "error" in runs:
            lines.append(f"| {key} | error | | | | | | | | | | | | | |")
            continue
        p, k = runs["plain"], runs["kmgpu"]
        row = [*key.split(" | ")]
        sp = {}
        for m in ("fit", "fit+val"):
            a, b = best(p, m), best(k, m)
            sp[m] = b / a
            row += [f"{a:,.0f}", f"{b:,.0f}", f"{b / a:.2f}x"]
        row.append(f"{sp['fit+val'] / sp['fit']:.2f}")
        if "kmgpu tf32=False" in runs:
            row[0] += (f" (kmgpu tf32=False: fit {best(runs['kmgpu tf32=False'], 'fit'):,.0f}, "
                       f"fit+val {best(runs['kmgpu tf32=False'], 'fit+val'):,.0f})")
        for m in ("evaluate", "predict"):
            a, b = best(p, m, min), best(k, m, min)
            row += ([f"{a:.3f}", f"{b:.3f}", f"{a / b:.2f}x"] if a and b else ["", "", ""])
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def save(out):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{ARGS.part}.json"), "w") as f:
        json.dump(OUT, f, indent=1, default=str)
    if OUT["bench"]:
        with open(os.path.join(out, "table.md"), "w") as f:
            f.write(markdown())


def main():
    global ARGS
    p = argparse.ArgumentParser()
    p.add_argument("--part", choices=["check", "bench", "ranks"], required=True)
    p.add_argument("--set", choices=["issue", "default"], default="issue",
                   help="bench: the issue's models, or torch_default.py's model set")
    p.add_argument("--checks", nargs="*", help="substrings of check names")
    p.add_argument("--budget", type=float, default=1e9, help="bench: seconds for models")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", nargs="*", help="policies")
    p.add_argument("--models", nargs="*", help="substrings of model names")
    p.add_argument("--out", default="/tmp/whole_run")
    ARGS = p.parse_args()
    import torch

    OUT["info"] = {"torch": torch.__version__, "cuda": cuda(),
                   "gpu": torch.cuda.get_device_name() if cuda() else None}
    if ARGS.part in ("check", "ranks"):
        checks(ARGS.quick)
    else:
        bench(ARGS.quick, ARGS.only)
    save(ARGS.out)
    if OUT["bench"]:
        print(markdown())
    log("done")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
