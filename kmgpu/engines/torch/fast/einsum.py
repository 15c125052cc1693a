"""``EinsumDense.call`` with the bias in the matmul, for the equations that are a Dense
over flattened axes (``MultiHeadAttention``'s query, key, value and output projections,
keras-hub's attention and feed-forward layers).

Keras 3.15.1 runs ``einsum`` and then a separate ``add`` of the bias over the whole output,
a broadcast that takes torch's generic elementwise kernel. Where the equation contracts
the inputs' trailing axes and the bias covers exactly the kernel's output axes, the same
product is ``F.linear`` over 2-D views (addmm: cuBLAS adds the bias in its epilogue), as
``layers.dense_call`` does for ``Dense``. Any other equation, a quantized layer, no bias or
dtypes that differ go to Keras's own call.
"""

import functools
import re

import torch.nn.functional as F

from kmgpu.engines.torch.fast import layers


@functools.lru_cache(maxsize=256)
def plan(equation, bias_axes):
    """How ``equation`` runs as ``F.linear``: (lead, kept, order), or a str saying why not.

    lead: the input's leading axes (kept in the output, in order) count; kept: the kernel's
    output axes count; order: the kernel's axes permuted to (contracted..., output...),
    None where they are in that order already.
    """
    m = re.fullmatch(r"([a-z]+),([a-z]+)->([a-z]+)", equation.replace(" ", ""))
    if m is None:
        return "an equation with an ellipsis or other than two operands"
    x, k, out = m.groups()
    if len(set(x)) < len(x) or len(set(k)) < len(k) or len(set(out)) < len(out):
        return "a repeated axis"
    contracted = [c for c in x if c in k and c not in out]
    lead = x[:len(x) - len(contracted)]
    outs = [c for c in k if c not in contracted]
    if x != lead + "".join(contracted) or set(lead) & set(k) or out != lead + "".join(outs):
        return "not a product over the inputs' trailing axes"
    if bias_axes != "".join(outs):
        return "a bias over other axes than the kernel's output axes"
    order = [k.index(c) for c in contracted + outs]
    return len(lead), len(outs), None if order == sorted(order) else tuple(order)


def why_not(layer, inputs):
    """Why ``call`` hands this call to Keras's own (None: it does not): ``Dense``'s reasons
    (``layers.dense_why_not``), then the equation's (``plan``)."""
    how = plan(layer.equation, layer.bias_axes or "")
    if isinstance(how, str):
        return layers.dense_why_not(layer, inputs, rank=1) or how
    return layers.dense_why_not(layer, inputs, rank=how[0] + 1)


def call(layer, inputs, training=None, *, fallback):
    """``EinsumDense.call``: ``F.linear`` over (rows, contracted) and (contracted, outputs)
    views where ``plan`` allows, the activation after, as Keras; else ``fallback``."""
    weights = None if why_not(layer, inputs) else layers.linear_weights(layer, inputs.dtype)
    if weights is None:
        return fallback(layer, inputs, training=training)
    kernel, bias = weights
    lead, kept, order = plan(layer.equation, layer.bias_axes)
    if order is not None:
        kernel = kernel.permute(order)
    out_shape = tuple(kernel.shape[kernel.dim() - kept:])
    x = inputs.reshape(*inputs.shape[:lead], -1)
    weight = kernel.reshape(x.shape[-1], -1)
    x = F.linear(x, weight.t(), bias.reshape(-1)).reshape(*inputs.shape[:lead], *out_shape)
    return x if layer.activation is None else layer.activation(x)


def method(original):
    """An ``EinsumDense.call`` (Keras's signature) that runs ``call``, falling back to
    ``original`` (Keras's own call)."""
    return layers.layer_method(original, call)
