"""Model builders of the benchmark workloads (Keras functional models, built-in layers only,
so every engine can re-create them from their config).

Full size on GPUs: ``keras.applications`` Xception / ResNet50 (``weights=None``, logits out)
and the GPT-style decoder below. ``--quick`` (a CPU, CI) keeps each architecture's kind of
block and shrinks depth, width and image size: ``xception_mini`` and ``resnet_mini`` here.
"""


def cnn32(width):
    """Three stages of two 3x3 Conv + BatchNorm + ReLU (width, 2x, 4x filters), max-pool
    after each stage, global average pool, Dense 10."""
    import keras

    inputs = keras.Input((32, 32, 3))
    h = inputs
    for stage in range(3):
        for _ in range(2):
            h = keras.layers.Conv2D(width * 2**stage, 3, padding="same", use_bias=False)(h)
            h = keras.layers.BatchNormalization()(h)
            h = keras.layers.Activation("relu")(h)
        h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(inputs, keras.layers.Dense(10)(h), name="cnn32")


def lstm(width, steps):
    import keras

    return keras.Sequential([
        keras.Input((steps, 16)),
        keras.layers.LSTM(width, return_sequences=True),
        keras.layers.LSTM(width),
        keras.layers.Dense(1),
    ], name="lstm")


def application(name, image, classes):
    """``keras.applications.<name>(weights=None)`` with logits out."""
    import keras

    build = getattr(keras.applications, name)
    return build(weights=None, input_shape=(image, image, 3), classes=classes,
                 classifier_activation=None)


def resnet_mini(image, classes, width=8, blocks=(1, 1, 1, 1)):
    """ResNet-50's layout (7x7 stem, max-pool, bottleneck blocks 1x1-3x3-1x1 with 4x
    expansion and BatchNorm, projection shortcuts) with ``blocks`` per stage and
    ``width`` stem filters; blocks=(3, 4, 6, 3), width=64 is ResNet-50."""
    import keras

    L = keras.layers
    inputs = keras.Input((image, image, 3))
    h = L.Conv2D(width, 7, strides=2, padding="same", use_bias=False)(inputs)
    h = L.Activation("relu")(L.BatchNormalization()(h))
    h = L.MaxPooling2D(3, strides=2, padding="same")(h)
    for stage, count in enumerate(blocks):
        filters = width * 2**stage
        for block in range(count):
            strides = 2 if (block == 0 and stage > 0) else 1
            shortcut = h
            if block == 0:
                shortcut = L.Conv2D(4 * filters, 1, strides=strides, use_bias=False)(h)
                shortcut = L.BatchNormalization()(shortcut)
            x = L.Conv2D(filters, 1, strides=strides, use_bias=False)(h)
            x = L.Activation("relu")(L.BatchNormalization()(x))
            x = L.Conv2D(filters, 3, padding="same", use_bias=False)(x)
            x = L.Activation("relu")(L.BatchNormalization()(x))
            x = L.Conv2D(4 * filters, 1, use_bias=False)(x)
            x = L.BatchNormalization()(x)
            h = L.Activation("relu")(L.Add()([x, shortcut]))
    h = L.GlobalAveragePooling2D()(h)
    return keras.Model(inputs, L.Dense(classes)(h), name="resnet_mini")


def xception_mini(image, classes, width=8, entry=2, middle=1):
    """Xception's layout (entry flow of separable-conv blocks with strided 1x1 shortcuts,
    ``middle`` residual blocks of three separable convs, exit flow) at ``width``
    (Xception: 32) with ``entry`` entry blocks (Xception: 3, ending at 728 filters)."""
    import keras

    L = keras.layers
    inputs = keras.Input((image, image, 3))
    h = L.Conv2D(width, 3, strides=2, padding="same", use_bias=False)(inputs)
    h = L.Activation("relu")(L.BatchNormalization()(h))
    h = L.Conv2D(2 * width, 3, padding="same", use_bias=False)(h)
    h = L.Activation("relu")(L.BatchNormalization()(h))
    for filters in [4 * width * 2**i for i in range(entry)]:
        shortcut = L.BatchNormalization()(
            L.Conv2D(filters, 1, strides=2, padding="same", use_bias=False)(h))
        x = L.SeparableConv2D(filters, 3, padding="same", use_bias=False)(h)
        x = L.Activation("relu")(L.BatchNormalization()(x))
        x = L.BatchNormalization()(L.SeparableConv2D(filters, 3, padding="same",
                                                     use_bias=False)(x))
        x = L.MaxPooling2D(3, strides=2, padding="same")(x)
        h = L.Add()([x, shortcut])
    for _ in range(middle):
        x = h
        for _ in range(3):
            x = L.Activation("relu")(x)
            x = L.BatchNormalization()(L.SeparableConv2D(filters, 3, padding="same",
                                                         use_bias=False)(x))
        h = L.Add()([x, h])
    h = L.SeparableConv2D(16 * width, 3, padding="same", use_bias=False)(h)
    h = L.Activation("relu")(L.BatchNormalization()(h))
    h = L.GlobalAveragePooling2D()(h)
    return keras.Model(inputs, L.Dense(classes)(h), name="xception_mini")


def transformer(vocab, seq, d_model, heads, ffn, blocks):
    """A GPT-style decoder LM: token embedding, a learned position table, ``blocks``
    pre-LayerNorm blocks (causal multi-head self-attention, GELU feed-forward, residuals),
    a final LayerNorm and logits over the vocabulary at every position.

    The position table is the bias of an EinsumDense (seq x d_model) over the token
    embeddings (it also mixes them with a d_model x d_model kernel): a learned absolute
    position embedding from built-in layers only. That kernel adds 2 d_model^2 FLOPs per
    token (1.5% at full size)."""
    import keras

    L = keras.layers
    tokens = keras.Input((seq,), dtype="int32")
    h = L.Embedding(vocab, d_model)(tokens)
    h = L.EinsumDense("btd,de->bte", output_shape=(seq, d_model), bias_axes="te",
                      name="positions")(h)
    for _ in range(blocks):
        x = L.LayerNormalization(epsilon=1e-5)(h)
        x = L.MultiHeadAttention(heads, key_dim=d_model // heads)(x, x, use_causal_mask=True)
        h = L.Add()([h, x])
        x = L.LayerNormalization(epsilon=1e-5)(h)
        x = L.Dense(ffn, activation="gelu")(x)
        x = L.Dense(d_model)(x)
        h = L.Add()([h, x])
    h = L.LayerNormalization(epsilon=1e-5)(h)
    return keras.Model(tokens, L.Dense(vocab)(h), name="transformer")
