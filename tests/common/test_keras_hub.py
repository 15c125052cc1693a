"""keras-hub task models fine-tuned under kmgpu equal one device: a causal LM (GPT-2, Llama)
on token ids, with LoRA, and with its preprocessor on raw strings after a preset round
trip; a BERT classifier; a ResNet image classifier; a BART seq2seq LM. Tiny random configs
made here (2 layers, hidden 16, vocabulary under 100): nothing is downloaded.

Each case trains a plain Keras copy and a kmgpu copy from the same weights for 2 epochs
(``shuffle=False``) and compares the weights (1e-5 relative), the History and
``predict``; afterwards the user's task model works on its own as keras-hub documents it
(``generate``, ``save_to_preset``, ``predict`` with its preprocessor).
"""

import numpy as np
import pytest

import kmgpu
from tests.helpers import assert_trained_alike, few_steps, rel_diff

keras_hub = pytest.importorskip("keras_hub")

TOL = 1e-5
ROWS, LENGTH, VOCAB = 16, 8, 96


def _compiled(model, optimizer=None):
    import keras

    model.compile(optimizer=optimizer or keras.optimizers.AdamW(1e-3),
                  weighted_metrics=["accuracy"])
    return model


def _fit_both(make, n, x, y=None, sample_weight=None, batch_size=4, **options):
    """A plain Keras model and a kmgpu one on ``n`` devices, the same weights, 2 epochs.

    Returns:
        (reference, the user's model, its ParallelModel, kmgpu's History).
    """
    import keras

    keras.utils.set_random_seed(0)
    ref, model = make(), make()
    model.set_weights(ref.get_weights())
    before = [w.copy() for w in model.get_weights()]
    args = dict(batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    ref.fit(x, y, sample_weight=sample_weight, **args)
    parallel = kmgpu.parallelize(model, gpus=n, **options)
    with few_steps():
        history = parallel.fit(x, y, sample_weight=sample_weight, **args)
    assert parallel.num_replicas == n
    assert rel_diff(before, model.get_weights()) > 1e-4, "the model did not train"
    assert_trained_alike(ref, model, TOL)  # the key biases to 1e-3 (predict: below)
    assert history.history.keys() == ref.history.history.keys()
    for key, values in ref.history.history.items():
        np.testing.assert_allclose(history.history[key], values, rtol=1e-5, atol=1e-6)
    return ref, model, parallel, history


def _assert_predicts_alike(parallel, ref, x, batch_size=4):
    got = parallel.predict(x, batch_size=batch_size, verbose=0)
    want = ref.predict(x, batch_size=batch_size, verbose=0)
    for a, b in zip(np.atleast_1d(got) if not isinstance(got, dict) else got.values(),
                    np.atleast_1d(want) if not isinstance(want, dict) else want.values()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    return got


def _tokens(rows=ROWS, length=LENGTH, seed=0):
    """Token ids with a padding mask (a third of the rows padded at the end)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, VOCAB, size=(rows, length + 1)).astype("int32")
    mask = np.ones_like(ids, dtype=bool)
    mask[::3, length - 2:] = False
    ids[~mask] = 0
    return ids, mask


def _causal(family, lora):
    def make():
        if family == "gpt2":
            backbone = keras_hub.models.GPT2Backbone(
                vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=16,
                intermediate_dim=32, max_sequence_length=16, dropout=0.0)
            model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
        else:
            backbone = keras_hub.models.LlamaBackbone(
                vocabulary_size=VOCAB, num_layers=2, num_query_heads=2,
                num_key_value_heads=1, hidden_dim=16, intermediate_dim=32)
            model = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
        if lora:
            model.backbone.enable_lora(rank=4)
        return _compiled(model)

    return make


#: GPT-2 without LoRA: the preset test below, on 4 devices
@pytest.mark.parametrize("family,lora,n", [("gpt2", True, 4), ("llama", False, 2)])
def test_causal_lm_on_token_ids(family, lora, n):
    """Fitted as the keras-hub guides do without a preprocessor: ids, a padding mask, the
    ids shifted by one as labels, the mask as sample weights."""
    ids, mask = _tokens()
    x = {"token_ids": ids[:, :-1], "padding_mask": mask[:, :-1]}
    ref, model, parallel, _ = _fit_both(_causal(family, lora), n, x, ids[:, 1:],
                                        mask[:, 1:].astype("float32"))
    if lora:
        frozen = [v for v in model.weights if not v.trainable]
        assert frozen and any("lora_kernel_b" in v.path for v in model.trainable_weights)
    _assert_predicts_alike(parallel, ref, x)


def _gpt2_tokenizer():
    """A byte-pair tokenizer of GPT-2's kind over a tiny vocabulary: the letters, each
    with and without the leading space mark, and the end token."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocabulary = {"<|endoftext|>": 0, "\u0120": 1}
    for c in letters:
        vocabulary[c] = len(vocabulary)
        vocabulary["\u0120" + c] = len(vocabulary)
    merges = [f"\u0120 {c}" for c in letters]
    return keras_hub.models.GPT2Tokenizer(vocabulary=vocabulary, merges=merges)


SENTENCES = ["the cat sat on the mat", "a dog ran far", "we like tea", "it is a day",
             "go to bed now", "the sun is up", "my cap is red", "you can do it",
             "a big red bus", "he had a nap", "she met a fox", "do not run",
             "we sat in sun", "an owl at dusk", "put it on top", "the end"]


def test_causal_lm_with_its_preprocessor_from_a_preset(tmp_path):
    """A GPT-2 causal LM with its preprocessor saved with ``save_to_preset``, loaded twice
    with ``from_preset`` and fine-tuned on raw strings on 4 devices; afterwards the user's
    model generates, saves and predicts as keras-hub documents, as the plain one does."""
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=55, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32,
        max_sequence_length=16, dropout=0.0)
    preprocessor = keras_hub.models.GPT2CausalLMPreprocessor(tokenizer=_gpt2_tokenizer(),
                                                             sequence_length=10)
    keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=preprocessor) \
        .save_to_preset(str(tmp_path / "start"))

    def make():
        return _compiled(keras_hub.models.CausalLM.from_preset(str(tmp_path / "start")))

    text = np.array(SENTENCES)
    ref, model, parallel, _ = _fit_both(make, 4, text)
    assert type(model).__name__ == "GPT2CausalLM" and model.preprocessor is not None
    _assert_predicts_alike(parallel, ref, text[:6])

    # the user's model on its own, as keras-hub documents it
    model.compile(sampler="greedy")
    ref.compile(sampler="greedy")
    assert model.generate(["the cat"], max_length=10) == ref.generate(["the cat"], max_length=10)
    model.save_to_preset(str(tmp_path / "tuned"))
    again = keras_hub.models.CausalLM.from_preset(str(tmp_path / "tuned"))
    np.testing.assert_allclose(again.predict(text[:4], verbose=0),
                               ref.predict(text[:4], verbose=0), rtol=1e-5, atol=1e-5)


def test_bert_classifier():
    def make():
        backbone = keras_hub.models.BertBackbone(
            vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=16,
            intermediate_dim=32, max_sequence_length=LENGTH, dropout=0.0)
        return _compiled(keras_hub.models.BertTextClassifier(
            backbone=backbone, num_classes=3, preprocessor=None, dropout=0.0))

    ids, mask = _tokens()
    x = {"token_ids": ids[:, :-1], "padding_mask": mask[:, :-1],
         "segment_ids": np.zeros_like(ids[:, :-1])}
    y = np.arange(ROWS) % 3
    ref, _, parallel, _ = _fit_both(make, 2, x, y)
    _assert_predicts_alike(parallel, ref, x, batch_size=5)


def test_resnet_image_classifier():
    """BatchNormalization's moments over the global batch (``sync_batchnorm=True``), as
    one device has them. (A ViT with Adam is left out on purpose: its attention key bias
    has a zero gradient in exact arithmetic, which Adam turns into full-size steps of
    rounding noise, and on TensorFlow its position embedding's sparse gradient arrives
    from the replicas as separate pieces that Keras's Adam squares apart: docs/keras-hub.md.)"""
    def make():
        backbone = keras_hub.models.ResNetBackbone(
            input_conv_filters=[64], input_conv_kernel_sizes=[3],
            stackwise_num_filters=[64], stackwise_num_blocks=[1],
            stackwise_num_strides=[1], block_type="basic_block", image_shape=(8, 8, 3))
        return _compiled(keras_hub.models.ResNetImageClassifier(
            backbone=backbone, num_classes=3, preprocessor=None), "sgd")

    x = np.random.default_rng(2).uniform(size=(ROWS, 8, 8, 3)).astype("float32")
    y = np.arange(ROWS) % 3
    ref, _, parallel, _ = _fit_both(make, 2, x, y, sync_batchnorm=True)
    _assert_predicts_alike(parallel, ref, x, batch_size=6)


def test_bart_seq2seq_lm():
    def make():
        backbone = keras_hub.models.BartBackbone(
            vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=16,
            intermediate_dim=32, dropout=0.0, max_sequence_length=16)
        return _compiled(keras_hub.models.BartSeq2SeqLM(backbone=backbone,
                                                        preprocessor=None))

    source, source_mask = _tokens(seed=3)
    target, target_mask = _tokens(seed=4)
    x = {"encoder_token_ids": source[:, :-1], "encoder_padding_mask": source_mask[:, :-1],
         "decoder_token_ids": target[:, :-1], "decoder_padding_mask": target_mask[:, :-1]}
    ref, _, parallel, _ = _fit_both(make, 2, x, target[:, 1:],
                                    target_mask[:, 1:].astype("float32"))
    _assert_predicts_alike(parallel, ref, x)
