"""The full-size workloads are the models it names (parameter counts, shapes, the
transformer's FLOPs by hand). They are built once, in the TensorFlow session: TensorFlow
builds them fastest.
"""

from kmgpu.bench import workloads


def test_full_size_workloads_as_issue_14_says():
    from kmgpu.bench import flops, runners

    expected = {  # trainable parameters; the transformer's and its FLOPs by hand
        "xception": 22_855_952, "resnet50": 25_583_592, "resnet50_small": 23_555_082,
        # 8192 x 512 + (512^2 + 256 x 512) + 4 x (2048 + 4 x 512^2 + 2048
        # + 2 x 512 x 2048 + 2048 + 512) + 1024 + 512 x 8192 + 8192
        "transformer": 21_400_576}
    for name, params in expected.items():
        w = workloads.get(name, steps=1)
        model = w.build()
        assert runners.trainable_count(model) == params, name
        x, y = w.data()
        assert len(x) == w.samples() == w.batch
        assert x.shape[1:] == tuple(model.input.shape[1:])  # the data fits the model
        assert y.dtype.kind == "i" and w.loss == "sparse_ce_logits"
        if name == "transformer":
            assert model.output.shape[1:] == (256, 8192) and (x[:, 1:] == y[:, :-1]).all()
            t, d = 256, 512
            forward = (2 * t * d * d + 4 * (2 * t * 4 * d * d + 4 * t * t * d
                                           + 2 * t * 2 * d * 2048) + 2 * t * d * 8192)
            assert flops.analytic(model) == 3 * forward
        else:
            assert model.input.shape[1:3] == ((64, 64) if name == "resnet50_small"
                                              else (224, 224))
    assert [workloads.get("xception").batch, workloads.get("resnet50").batch,
            workloads.get("resnet50_small").batch, workloads.get("transformer").batch] == \
        [64, 256, 256, 64]
