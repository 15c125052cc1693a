"""Where the GPU time of Keras-on-torch's train step goes, kernel by kernel.
A script that prints Markdown tables, not a test.

    KERAS_BACKEND=torch python benchmarks/lab/torch_kernels.py [--quick] [--models resnet50,...]
        [--steps 5] [--tf32] [--cudnn-benchmark] [--top 20] [--out FILE.md]

Per model (ResNet-50 64x64 batch 256, EfficientNetB0 224 batch 64, a BERT-style encoder
batch 64; ``--models transformer,gru``: backends_balanced.py's bench transformer and masked
bidirectional GRU; ``--quick``: tiny stand-ins on a CPU), in one process:

keras-torch   kmgpu's split step (``graphs.SplitStep``: stage A forward+loss+gradients into
              the flat buffers, stage B ``optimizer.apply`` + loss tracker), run EAGERLY under
              ``torch.profiler`` inside ``graphs.step_context`` (device scalars and random
              draws, the fused BatchNorm and the fast ops on CUDA): the same kernels that the
              captured step records into its CUDA graphs (the graphs add only the copies of
              the batch into the static inputs). Each kernel
              is put in one category: ``optimizer`` (launched inside ``optimizer.apply``),
              ``batchnorm`` (inside a ``BatchNormalization.call``, or the backward of an op
              made there: autograd's sequence numbers), else by its launching op / kernel
              name: ``conv/matmul``, ``copies/permutes`` (copy_, contiguous, cuDNN's
              nchwToNhwc, memcpy), ``elementwise`` (pointwise and reductions), ``other``.
captured      the same model's ``CapturedStep`` replayed (graphs A and B): kernels per step
              as the profiler sees them in the graph launches, and ms per step (CUDA events,
              median of 3 blocks of ``--steps`` replays): the step kmgpu runs.
torchvision   hand-written PyTorch: ``torchvision.models.resnet50`` (NCHW), CrossEntropyLoss,
              ``torch.optim.Adam`` (foreach), eager (ResNet-50 only; skipped without
              torchvision), same categories; on a GPU also hand-captured: channels-last,
              Adam ``capturable=True``, the whole step in one CUDA graph, replayed (kernels
              per step and ms per step as for "captured"); and hand-captured once more with
              a bias on each convolution, as Keras's ``ResNet50`` has (torchvision's has none:
              a BatchNorm follows each), the same network as the Keras rows.

Adam(1e-3) and SparseCategoricalCrossentropy(from_logits=True) everywhere; float32, TF32 as
torch's defaults (cuDNN on, matmul off). On a CPU (``--quick``) the "kernels" are the leaf
aten ops and the times CPU times: a smoke test of the script, nothing to read.
"""

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
os.environ.setdefault("KERAS_BACKEND", "torch")

from torch_profile import (CATEGORIES, label_optimizer, labelled,  # noqa: E402
                           profile_torch, timed, top_kernels)

MODELS = ("resnet50", "efficientnetb0", "bert")
TOP = 0  # --top
T0 = time.perf_counter()


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, file=sys.stderr, flush=True)


# -- the models (Keras, either backend) ----------------------------------------------------
def spec(name, quick):
    """(description, batch, x shape without the batch, input dtype, classes)."""
    if name == "resnet50":
        return (("ResNet-style mini 16x16" if quick else "ResNet-50 64x64"), 8 if quick else 256,
                (16, 16, 3) if quick else (64, 64, 3), "float32", 10)
    if name == "efficientnetb0":
        return (("EfficientNetB0 32x32" if quick else "EfficientNetB0 224x224"),
                2 if quick else 64, (32, 32, 3) if quick else (224, 224, 3), "float32",
                10 if quick else 1000)
    if name == "bert":
        return ("BERT-style encoder " + ("(tiny)" if quick else "4x256, seq 128"),
                4 if quick else 64, (16 if quick else 128,), "int32", 2)
    if name in SEQUENCE:  # jax_balanced.py's models (backends_balanced.py's table)
        w, _ = sequence_workload(name, quick)
        return (SEQUENCE[name] + (" (tiny)" if quick else ""), w.batch, w.input_shape, "int32",
                w.classes)
    raise ValueError(name)


# The sequence models of backends_balanced.py's table, built and fed by jax_balanced.py
SEQUENCE = {"transformer": "the bench's transformer (GPT-style decoder, 4x512, seq 256)",
            "gru": "bidirectional GRU 128 over Embedding(mask_zero=True), seq 128"}


def sequence_workload(name, quick):
    """(Workload, build function) from jax_balanced.py."""
    from jax_balanced import workload

    return workload(name, quick)


def bert(quick):
    """A BERT-style encoder: token + learned position embeddings, post-LayerNorm blocks of
    (bidirectional self-attention, add, LN, GELU FFN, add, LN), mean pool, a 2-class head.
    Full size: vocab 8192, seq 128, d_model 256, 4 heads, FFN 1024, 4 blocks."""
    import keras

    L = keras.layers
    vocab, seq, d, heads, ffn, blocks = ((128, 16, 32, 2, 64, 2) if quick
                                         else (8192, 128, 256, 4, 1024, 4))
    tokens = keras.Input((seq,), dtype="int32")
    h = L.Embedding(vocab, d)(tokens)
    h = L.EinsumDense("btd,de->bte", output_shape=(seq, d), bias_axes="te")(h)
    h = L.LayerNormalization(epsilon=1e-12)(h)
    for _ in range(blocks):
        a = L.MultiHeadAttention(heads, key_dim=d // heads)(h, h)
        h = L.LayerNormalization(epsilon=1e-12)(L.Add()([h, a]))
        f = L.Dense(d)(L.Dense(ffn, activation="gelu")(h))
        h = L.LayerNormalization(epsilon=1e-12)(L.Add()([h, f]))
    h = L.GlobalAveragePooling1D()(h)
    return keras.Model(tokens, L.Dense(2)(h), name="bert_encoder")


def build(name, quick):
    import keras

    keras.utils.set_random_seed(0)
    _, _, shape, _, classes = spec(name, quick)
    if name == "resnet50":
        if quick:
            from kmgpu.bench import models

            return models.resnet_mini(16, 10, width=4, blocks=(1, 1))
        return keras.applications.ResNet50(weights=None, input_shape=shape, classes=classes,
                                           classifier_activation=None)
    if name == "efficientnetb0":
        return keras.applications.EfficientNetB0(weights=None, input_shape=shape,
                                                 classes=classes, classifier_activation=None)
    if name in SEQUENCE:
        return sequence_workload(name, quick)[1]()
    return bert(quick)


def compiled(name, quick, sgd=False):
    import keras

    model = build(name, quick)
    model.compile(optimizer=(keras.optimizers.SGD(0.01, momentum=0.9) if sgd else
                             keras.optimizers.Adam(1e-3)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def batch_arrays(name, quick):
    import numpy as np

    _, batch, shape, dtype, classes = spec(name, quick)
    if name in SEQUENCE:
        from jax_balanced import data

        x, y = data(sequence_workload(name, quick)[0])
        return x[:batch], y[:batch]
    rng = np.random.default_rng(0)
    if dtype == "int32":
        x = rng.integers(0, 128 if quick else 8192, size=(batch, *shape)).astype("int32")
    else:
        x = rng.standard_normal((batch, *shape), dtype=np.float32)
    return x, rng.integers(0, classes, size=(batch,)).astype("int32")


def keras_torch(name, quick, steps, gpu, tf32=None):
    """``tf32``: the float32 matmul policy of both steps (None: torch's global settings,
    full float32 matmuls; True: TF32, kmgpu's default inside ``parallelize``)."""
    from kmgpu.engines.torch import precision

    with precision.matmul_precision(tf32):
        return _keras_torch(name, quick, steps, gpu, tf32)


def _keras_torch(name, quick, steps, gpu, tf32):
    import torch

    from kmgpu.engines.torch.capture import graphs

    labelled()
    model = compiled(name, quick)
    dev = "cuda" if gpu else "cpu"
    xn, yn = batch_arrays(name, quick)
    x, y = torch.as_tensor(xn, device=dev), torch.as_tensor(yn, device=dev)
    model(x[:1])  # build on the device
    n = int(x.shape[0])
    label_optimizer(model.optimizer)
    split = graphs.SplitStep(model)

    def eager():  # within what the captured step runs in: its fused and fast kernels
        with graphs.step_context(model, dev, tf32):
            split.layout()
            return split.step(x, y, None, n, n)

    for _ in range(3):
        eager()
    res = {"trainable variables": len(model.trainable_weights)}
    res["eager"], _, _ = profile_torch(eager, steps, gpu)
    if TOP:  # --top: the elementwise kernels and copies that take the most time, by op
        for category in ("elementwise", "copies/permutes"):
            res["top " + category] = top_kernels(eager, steps, gpu, category, TOP)
    res["eager ms"] = timed(eager, steps, gpu)
    if gpu:
        step = graphs.local_step(model, tf32=tf32)
        for _ in range(graphs.WARMUP_STEPS + 2):
            step.train_step((x, y))
        res["captured"] = bool(step.graphs) and step.reason is None
        _, res["captured kernels"], res["captured kernel ms"] = profile_torch(
            lambda: step.train_step((x, y)), steps, gpu)
        res["captured ms"] = timed(lambda: step.train_step((x, y)), steps, gpu)
        step.close()
    return res


def torchvision_resnet(quick, steps, gpu):
    import torch

    try:
        import torchvision
    except ImportError:
        return None
    dev = "cuda" if gpu else "cpu"
    model = torchvision.models.resnet50(num_classes=10).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.CrossEntropyLoss()
    xn, yn = batch_arrays("resnet50", quick)
    x = torch.as_tensor(xn, device=dev).permute(0, 3, 1, 2).contiguous()
    y = torch.as_tensor(yn, device=dev).long()

    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    for _ in range(3):
        step()
    res = {"trainable variables": len(list(model.parameters()))}
    res["eager"], _, _ = profile_torch(step, steps, gpu)
    res["eager ms"] = timed(step, steps, gpu)
    if gpu:
        for biases, prefix in ((False, ""), (True, "biased ")):
            try:
                captured = hand_captured(torchvision, x, y, loss_fn, steps, gpu, biases)
                res.update({prefix + k: v for k, v in captured.items()})
            except Exception as e:  # the eager rows still stand
                res[prefix + "captured error"] = f"{type(e).__name__}: {str(e)[:200]}"
                log(res[prefix + "captured error"])
    return res


def with_conv_biases(model):
    """``model`` with a zero bias on every convolution that has none (Keras's ResNet50 has
    one on each); returns the number added."""
    import torch

    added = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Conv2d) and m.bias is None:
            m.bias = torch.nn.Parameter(torch.zeros(m.out_channels, device=m.weight.device))
            added += 1
    return added


def hand_captured(torchvision, x, y, loss_fn, steps, gpu, biases=False):
    """The hand-written PyTorch loop at its fastest: ResNet-50 channels-last, Adam with
    ``capturable=True`` (its step count on the device), the whole step (forward, backward,
    update) recorded into one CUDA graph as PyTorch's CUDA-graph notes show, replayed;
    ``biases``: with a bias on each convolution (``with_conv_biases``)."""
    import torch

    model = torchvision.models.resnet50(num_classes=10).cuda()
    if biases:
        with_conv_biases(model)
    model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=True, foreach=True)
    static_x = x.contiguous(memory_format=torch.channels_last).clone()
    static_y = y.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture needs
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            loss_fn(model(static_x), static_y).backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        loss_fn(model(static_x), static_y).backward()
        opt.step()
    for _ in range(3):
        graph.replay()
    _, n, ms = profile_torch(graph.replay, steps, gpu)
    return {"captured kernels": n, "captured kernel ms": ms,
            "captured ms": timed(graph.replay, steps, gpu)}


def row(label, per, ms):
    total_n = sum(n for n, _ in per.values())
    total_ms = sum(t for _, t in per.values())
    cells = [f"{per[c][0]:.0f} / {per[c][1]:.2f}" for c in CATEGORIES]
    return f"| {label} | {total_n:.0f} / {total_ms:.2f} | " + " | ".join(cells) + \
        f" | {ms:.2f} |"


def markdown(results, gpu):
    unit = "kernels / GPU ms" if gpu else "leaf CPU ops / CPU ms (smoke test)"
    lines = [f"Per step: {unit} per category; the last column is wall ms per step.", "",
             "| model, step | total | " + " | ".join(CATEGORIES) + " | ms/step |",
             "|---" * (len(CATEGORIES) + 3) + "|"]
    for name, r in results.items():
        t = r.get("torch") or {}
        if "eager" in t:
            lines.append(row(f"{r['desc']}: Keras-torch split step, eager "
                             f"({t['trainable variables']} variables)", t["eager"],
                             t["eager ms"]))
        v = r.get("torchvision")
        if v:
            lines.append(row(f"{r['desc']}: torchvision resnet50, eager, torch Adam "
                             f"({v['trainable variables']} variables)", v["eager"],
                             v["eager ms"]))
    lines += ["", "| model | kmgpu captured: kernels / GPU ms per step | captured ms/step |",
              "|---|---|---|"]
    for name, r in results.items():
        t = r.get("torch") or {}
        cap = (f"{t['captured kernels']:.0f} / {t['captured kernel ms']:.2f}"
               if "captured kernels" in t else "-")
        cap_ms = f"{t['captured ms']:.2f}" if "captured ms" in t else "-"
        lines.append(f"| {r['desc']} | {cap} | {cap_ms} |")
        v = r.get("torchvision") or {}
        for prefix, words in (("", ""), ("biased ", ", a bias on each convolution (as Keras's)")):
            if prefix + "captured ms" in v:
                lines.append(f"| {r['desc']}: torchvision resnet50, channels-last, hand-captured "
                             f"whole step{words} | {v[prefix + 'captured kernels']:.0f} / "
                             f"{v[prefix + 'captured kernel ms']:.2f} | "
                             f"{v[prefix + 'captured ms']:.2f} |")
    for name, r in results.items():
        for category in ("elementwise", "copies/permutes"):
            top = (r.get("torch") or {}).get("top " + category)
            if top:
                lines += ["", f"{r['desc']}: the {category} kernels with the most GPU time "
                          "per step (Keras-torch step, eager)", "",
                          "| launching op | kernel | kernels | GPU ms |", "|---|---|---|---|"]
                lines += [f"| {op} | `{k}` | {n:.0f} | {ms:.3f} |" for op, k, n, ms in top]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--tf32", action="store_true",
                   help="torch's float32 matmuls in TF32 (kmgpu's default inside parallelize; "
                        "JAX's default precision); without it full float32")
    p.add_argument("--cudnn-benchmark", action="store_true",
                   help="torch.backends.cudnn.benchmark = True for every step (cuDNN times "
                        "its algorithms per shape and keeps the fastest); default off")
    p.add_argument("--top", type=int, default=0,
                   help="also list the TOP elementwise and copy kernels of the Keras-torch "
                        "step by GPU time, with the op that launched each")
    p.add_argument("--out")
    a = p.parse_args()
    global TOP
    TOP = a.top
    names = [m for m in a.models.split(",") if m]
    import torch

    torch.backends.cudnn.benchmark = a.cudnn_benchmark

    gpu = torch.cuda.is_available()
    results = {}
    for name in names:
        results[name] = {"desc": spec(name, a.quick)[0]}
        log(f"torch {name}")
        try:
            results[name]["torch"] = keras_torch(name, a.quick, a.steps, gpu,
                                                 tf32=True if a.tf32 else None)
        except Exception as e:
            results[name]["torch"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            log(results[name]["torch"]["error"])
        if name == "resnet50":
            results[name]["torchvision"] = torchvision_resnet(a.quick, a.steps, gpu)
        log(json.dumps(results[name]))
    text = markdown(results, gpu)
    print(text)
    print("JSON " + json.dumps(results))
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
        with open(os.path.splitext(a.out)[0] + ".json", "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
