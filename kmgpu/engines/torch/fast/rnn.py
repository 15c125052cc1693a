"""Keras's GRU and LSTM with a mask on torch's fused RNN kernel (cuDNN on CUDA), exact and
without a host read. ``fast_fixes`` swaps ``inner_loop_method`` in
place of ``GRU.inner_loop`` / ``LSTM.inner_loop`` inside kmgpu's steps on CUDA.

Keras 3.15.1's torch ``gru()`` / ``lstm()`` raise NotImplementedError whenever a mask is
given, so a masked layer (``Embedding(mask_zero=True)`` before it) runs Keras's generic
``rnn()`` loop: one Python iteration per timestep, each gate a separate kernel, forward
and backward (thousands of kernels per step for a bidirectional GRU over 128 steps).
torch's packed sequences need the lengths on the host, which
kmgpu's captured step cannot read. This module computes what the generic loop computes,
for any mask (right- or left-padded, holes, fully masked rows), on the device:

- **compaction**: per row, the valid timesteps move to the front in their order (valid
  step t to position cumsum(mask)[t] - 1, the masked ones after them, zeroed): a
  permutation from ``cumsum``, applied with ``gather`` (differentiable);
- one unmasked ``torch._VF.gru`` / ``torch._VF.lstm`` (the call Keras makes without a
  mask) over the compacted rows from the initial state: position k holds the state after
  the row's first k + 1 valid steps; the masked tail is computed but never read;
- **back**: the generic loop's output at step t is the state after the last valid step
  at or before t (``gather`` at cumsum(mask)[t] - 1), zeros before the first valid step,
  or zeros at every masked step under ``zero_output_for_mask``; its final state is the
  state after the row's last valid step (the initial state for a fully masked row); its
  ``last_output`` is the last output so defined. ``go_backwards``: inputs and mask are
  flipped first, as Keras does, and the outputs stay in that order.

The LSTM's final *cell* state at a row's last valid step is not among the kernel's
per-step outputs (only h is), so an LSTM takes this path only where the layer discards
its final states (not ``return_state``, not ``stateful``); the cell state it returns there
is NaN, so a use of it would show. What this module does not cover runs Keras's own
``inner_loop`` (``why_not``): no mask (Keras's own cuDNN call), ``use_cudnn=False``,
recurrent dropout, ``unroll``, ``reset_after=False``, no bias, activations other than
tanh/sigmoid, dtypes other than float32, symbolic tensors, tracing.

cuDNN reads a layer's weights from one buffer in a layout of its own; handed separate
tensors it copies them into a new buffer at every call and warns ("RNN module weights are
not part of single contiguous chunk of memory"). So the weights, reordered to torch's
gates, are written straight into that layout (one ``cat``, differentiable) and handed to
the kernel as views of it (``one_buffer``). The layout comes from torch's own
``_cudnn_rnn_flatten_weight``, learnt once per shape (``cudnn_layout``).
"""

import torch

_LAYOUTS = {}  # (kind, input size, units, dtype, device) -> (offsets, total)


def why_not(layer, sequences, mask, kind):
    """Why ``inner_loop`` hands this call to Keras's own (None: it does not). ``kind`` is
    "gru" or "lstm"."""
    import keras

    cell = layer.cell
    if mask is None:
        return "no mask (Keras's own cuDNN call)"
    if layer.use_cudnn is False:
        return "use_cudnn=False"
    if cell.recurrent_dropout:
        return "recurrent_dropout"
    if layer.unroll:
        return "unroll=True"
    if kind == "gru" and not cell.reset_after:
        return "reset_after=False"
    if kind == "lstm" and (layer.return_state or layer.stateful):
        return "an LSTM whose final cell state is used (return_state, stateful)"
    if not cell.use_bias:
        return "no bias"
    if cell.dropout and cell.implementation != 2:
        return "dropout with implementation=1"
    if cell.activation not in (keras.activations.tanh, keras.ops.tanh, torch.tanh) or \
            cell.recurrent_activation not in (keras.activations.sigmoid, keras.ops.sigmoid,
                                              torch.sigmoid):
        return "activations other than tanh and sigmoid"
    if not (torch.is_tensor(sequences) and torch.is_tensor(mask)) or \
            sequences.device.type == "meta" or sequences.dim() != 3:
        return "symbolic or not (batch, time, features) inputs"
    if mask.shape != sequences.shape[:2]:
        return "a mask of another shape than (batch, time)"
    if torch.jit.is_tracing() or torch.compiler.is_compiling():
        return "tracing"
    dtypes = {sequences.dtype} | {keras.ops.convert_to_tensor(w).dtype
                                  for w in (cell.kernel, cell.recurrent_kernel, cell.bias)}
    if dtypes != {torch.float32}:
        return f"dtypes {sorted(str(d) for d in dtypes)} (float32 only)"
    return None


def compaction(mask):
    """(source, count, cum) for a (batch, time) ``mask``: ``source[b, k]`` is the step that
    compacted position k of row b takes (the valid steps first, in order, then the masked
    ones), ``count`` the row's valid steps (batch, 1), ``cum`` cumsum(mask) along time."""
    m = mask.to(torch.bool)
    cum = torch.cumsum(m, dim=1)
    count = cum[:, -1:]
    steps = torch.arange(m.shape[1], device=m.device).expand_as(cum)
    dest = torch.where(m, cum - 1, count + steps - cum)  # a permutation of each row
    return torch.empty_like(dest).scatter_(1, dest, steps), count, cum


def _take(seq, index):
    """seq[b, index[b, k], :] for a (batch, time, units) ``seq``."""
    return torch.gather(seq, 1, index[..., None].expand(-1, -1, seq.shape[-1]))


def masked_rnn(kind, inputs, states, mask, params, return_sequences=False,
               go_backwards=False, zero_output_for_mask=False):
    """Keras's generic masked loop over a GRU ("gru": ``states`` [h]) or LSTM ("lstm":
    [h, c]) with torch's fused kernel (see the module); ``params`` are torch's
    [weight_ih, weight_hh, bias_ih, bias_hh]. Returns Keras's (last_output, outputs,
    states): outputs (batch, time, units), or (batch, 1, units) without
    ``return_sequences``; the LSTM's final cell state NaN (see the module)."""
    if go_backwards:
        inputs, mask = torch.flip(inputs, [1]), torch.flip(mask, [1])
    mask = mask.to(torch.bool)
    source, count, cum = compaction(mask)
    valid = torch.arange(mask.shape[1], device=mask.device) < count
    compact = torch.where(valid[..., None], _take(inputs, source), 0.0)
    h0 = states[0]
    if kind == "gru":
        seq, _ = torch._VF.gru(compact, h0[None], params, True, 1, 0.0,
                               torch.is_grad_enabled(), False, True)
    else:
        seq, _, _ = torch._VF.lstm(compact, (h0[None], states[1][None]), params, True, 1,
                                   0.0, torch.is_grad_enabled(), False, True)
    seen = count > 0
    last = _take(seq, (count - 1).clamp(min=0))[:, 0]
    h = torch.where(seen, last, h0)
    if zero_output_for_mask:
        last_output = torch.where(mask[:, -1:], last, 0.0)
    else:
        last_output = torch.where(seen, last, 0.0)
    if return_sequences:
        keep = mask if zero_output_for_mask else cum > 0
        outputs = torch.where(keep[..., None], _take(seq, (cum - 1).clamp(min=0)), 0.0)
    else:
        outputs = last_output[:, None]
    if kind == "gru":
        return last_output, outputs, [h]
    return last_output, outputs, [h, torch.full_like(h, float("nan"))]


def gru_params(kernel, recurrent_kernel, bias):
    """torch's GRU weights from Keras's (``reset_after=True``): the gates from Keras's
    [z, r, h] to torch's [r, z, n], transposed; bias rows are (input, recurrent)."""

    def order(w):
        z, r, h = torch.chunk(w, 3, dim=-1)
        return torch.cat([r, z, h], dim=-1)

    return [order(kernel).t().contiguous(), order(recurrent_kernel).t().contiguous(),
            order(bias[0]).contiguous(), order(bias[1]).contiguous()]


def lstm_params(kernel, recurrent_kernel, bias):
    """torch's LSTM weights from Keras's (the same gate order [i, f, c, o]), transposed;
    Keras has one bias, torch's recurrent bias is zero."""
    return [kernel.t().contiguous(), recurrent_kernel.t().contiguous(), bias.contiguous(),
            torch.zeros_like(bias)]


def cudnn_layout(kind, params):
    """(offsets, total): where cuDNN wants each of ``params`` (torch's [weight_ih,
    weight_hh, bias_ih, bias_hh]) in its one weight buffer, in elements, and the buffer's
    size; None off cuDNN. Learnt from ``torch._cudnn_rnn_flatten_weight`` once per shape
    (each weight filled with its own value, found again in the flattened buffer), outside
    a CUDA graph capture."""
    weight = params[0]
    key = (kind, weight.shape[1], params[1].shape[1], weight.dtype, weight.device)
    if key in _LAYOUTS:
        return _LAYOUTS[key]
    if weight.device.type != "cuda" or not torch.backends.cudnn.is_available() or \
            not torch.backends.cudnn.enabled or torch.cuda.is_current_stream_capturing():
        return None
    from torch.backends.cudnn import rnn as cudnn_rnn

    with torch.no_grad():
        marked = [torch.full(p.shape, float(i + 1), dtype=p.dtype, device=p.device)
                  for i, p in enumerate(params)]
        flat = torch._cudnn_rnn_flatten_weight(
            marked, len(marked), key[1], cudnn_rnn.get_cudnn_mode(kind.upper()), key[2],
            0, 1, True, False)
        offsets = [int(torch.nonzero(flat == i + 1)[0, 0]) for i in range(len(marked))]
    _LAYOUTS[key] = (offsets, flat.numel())
    return _LAYOUTS[key]


def one_buffer(params, layout):
    """``params`` copied into one buffer laid out as ``layout`` ((offsets, total); zeros
    between them) by one differentiable ``cat``, returned as views of it."""
    offsets, total = layout
    pieces, end = [], 0
    for offset, p in sorted(zip(offsets, params), key=lambda pair: pair[0]):
        if offset > end:
            pieces.append(p.new_zeros(offset - end))
        pieces.append(p.reshape(-1))
        end = offset + p.numel()
    if total > end:
        pieces.append(params[0].new_zeros(total - end))
    flat = torch.cat(pieces)
    return [flat.narrow(0, offset, p.numel()).view(p.shape)
            for offset, p in zip(offsets, params)]


def inner_loop(layer, sequences, initial_state, mask, training=False, *, kind, fallback):
    """``GRU.inner_loop`` / ``LSTM.inner_loop`` (``kind`` "gru" / "lstm") through
    ``masked_rnn`` where ``why_not`` allows, else ``fallback`` (Keras's own). The input
    dropout as Keras's cuDNN call applies it (one mask over all timesteps: what
    implementation 2's cell multiplies each step by)."""
    import keras

    if keras.tree.is_nested(mask):
        mask = mask[0]
    if why_not(layer, sequences, mask, kind) is not None:
        return fallback(layer, sequences, initial_state, mask, training=training)
    cell = layer.cell
    if training and cell.dropout:
        sequences = sequences * cell.get_dropout_mask(sequences[:, 0, :])[:, None]
    weights = [keras.ops.convert_to_tensor(w)
               for w in (cell.kernel, cell.recurrent_kernel, cell.bias)]
    if kind == "gru":
        states = [initial_state[0] if keras.tree.is_nested(initial_state) else initial_state]
        params = gru_params(*weights)
    else:
        states, params = list(initial_state), lstm_params(*weights)
    states = [s.to(torch.float32) for s in states]
    layout = cudnn_layout(kind, params)
    if layout is not None:
        params = one_buffer(params, layout)
    return masked_rnn(kind, sequences, states, mask, params, layer.return_sequences,
                      layer.go_backwards, layer.zero_output_for_mask)


def inner_loop_method(original, kind):
    """An ``inner_loop`` (Keras's signature) that runs this module's, falling back to
    ``original`` (Keras's own)."""

    def method(self, sequences, initial_state, mask, training=False):
        return inner_loop(self, sequences, initial_state, mask, training, kind=kind,
                          fallback=original)

    method.__doc__ = original.__doc__
    method.__wrapped_by_kmgpu__ = original
    return method


def describe(model, on_gpu, enabled):
    """describe()'s words for the masked GRU/LSTM path inside kmgpu's steps ("" off a GPU,
    or when ``model`` has no GRU or LSTM layer)."""
    import keras

    kinds = sorted({type(layer).__name__ for layer in model._flatten_layers()
                    if isinstance(layer, (keras.layers.GRU, keras.layers.LSTM))})
    if not on_gpu or not kinds:
        return ""
    names = "/".join(kinds)
    if not enabled:
        return f"; {names} with a mask: Keras's own loop (KMGPU_TORCH_FAST_RNN=0)"
    return (f"; {names} with a mask: cuDNN over the compacted sequence inside these steps "
            "(KMGPU_TORCH_FAST_RNN=0: Keras's own loop)")
