"""Focus-DETR's foreground token selection and sparse encoder update (Zheng et al., ICCV 2023,
"Less is More: Focus Attention for Efficient DETR").

The encoder updates only the tokens most likely to be foreground; the rest keep their
backbone features. Reference: IDEA-Research/detrex, projects/focus_detr/modeling/
focus_detr_transformer.py (`MaskPredictor`, `FOCUS_DETRTransformer.forward`,
`FOCUS_DETRTransformerEncoder.forward`) and transformer_layer.py (the "OESM" step). The
foreground targets and their loss are in detr_tf/losses/foreground.py.

    memory [B, S, d] (the reference: enc_output_norm(enc_output(src + pos)), padded and
      border cells zeroed first, i.e. encoder_output_proposals' memory through the two-stage
      projection)
      -> ForegroundScorer: one shared MaskPredictor per level, coarsest first; each finer level's
         input is modulated by the coarser level's scores upsampled (top-down)
      -> fg logits [B, S] (the loss's input)
      -> selection_scores: padded tokens set to the batch's minimum
      -> select_tokens: top-K_0 indices [B, K_0]; encoder layer l uses the first K_l
      -> sparse_update per encoder layer: gather K_l tokens, update, scatter back

Static shapes. The reference keeps n_b = floor(valid_b * rho) + 1 tokens of image b and gathers
floor(c_l * max_b n_b) per layer l (c = the cascade ratios), numbers that depend on the batch's
padding. Here K_l = floor(c_l * N) with N = floor(S * rho) + 1 computed from the canvas (every
token valid), a trace-time constant >= the reference's count; `focus_write_counts` gives each
image the reference's count m_{l,b} = min(floor(c_l * max_b n_b), n_b), and `sparse_update`
writes back only the first m_{l,b} of the K_l gathered tokens. Without padding (the reference's
inference marks no token padded) the two coincide: m_{l,b} = K_l. The extra gathered tokens
change nothing for an update that treats every token as its own query (deformable attention
against the whole map, then the FFN); a step that mixes the gathered tokens (the reference's
self-attention among the top 300 by `multi_category_scores`) must leave out the slots at or
beyond `focus_gather_counts` to match the reference under padding.
"""
from typing import Callable, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf
import tf_keras

from detr_tf.modeling.activations import gelu_erf
from detr_tf.modeling.layers import layer_norm

# The reference's keep ratio rho and per-encoder-layer cascade (six layers).
FOCUS_RHO = 0.5
CASCADE = (1.0, 0.8, 0.6, 0.6, 0.4, 0.2)


def focus_counts(num_tokens: int, rho: float = FOCUS_RHO,
                 cascade: Sequence[float] = CASCADE) -> Tuple[int, ...]:
    """Static tokens gathered per encoder layer: K_l = floor(c_l * (floor(S * rho) + 1)).

    The products are float32 and truncated as the reference's `.int()` and `int(...)` do (its
    cascade is a float32 tensor: 0.6 is 0.60000002, so floor(0.6 * 5) is 3, not 2).

    Raises:
      ValueError: a count above num_tokens (top-k could not pick that many).
    """
    n = int(np.float32(num_tokens) * np.float32(rho)) + 1
    counts = tuple(int(np.float32(c) * np.float32(n)) for c in cascade)
    if max(counts) > num_tokens:
        raise ValueError(f"focus_counts: rho={rho} and cascade={tuple(cascade)} keep "
                         f"{max(counts)} of {num_tokens} tokens; use a smaller rho (below 1)")
    return counts


def _reference_counts(padding_mask: tf.Tensor, rho: float,
                      cascade: Sequence[float]) -> Tuple[tf.Tensor, tf.Tensor]:
    """(gathered [len(cascade)] int32, kept [B] int32): floor(c_l * max_b n_b) and n_b."""
    valid = tf.reduce_sum(tf.cast(~padding_mask, tf.float32), 1)  # [B]
    n = tf.cast(tf.floor(valid * rho), tf.int32) + 1  # [B]
    gathered = tf.cast(tf.floor(tf.constant(cascade, tf.float32)
                                * tf.cast(tf.reduce_max(n), tf.float32)), tf.int32)  # [Lenc]
    return gathered, n


def focus_gather_counts(padding_mask: tf.Tensor, rho: float = FOCUS_RHO,
                        cascade: Sequence[float] = CASCADE) -> tf.Tensor:
    """The reference's gathered count per encoder layer, floor(c_l * max_b n_b): [len(cascade)]
    int32 (see focus_write_counts), for a step that must see only those slots."""
    return _reference_counts(padding_mask, rho, cascade)[0]


def focus_write_counts(padding_mask: tf.Tensor, rho: float = FOCUS_RHO,
                       cascade: Sequence[float] = CASCADE) -> tf.Tensor:
    """The reference's per-image count of updated tokens: [len(cascade), B] int32.

    m_{l,b} = min(floor(c_l * max_b' n_b'), n_b), n_b = floor(valid_b * rho) + 1, with valid_b
    the real tokens of image b (padding_mask: [B, S] bool, True on padded tokens), in the
    reference's float32 arithmetic.
    """
    gathered, n = _reference_counts(padding_mask, rho, cascade)
    return tf.minimum(gathered[:, None], n[None])


def selection_scores(fg_logits: tf.Tensor, padding_mask: Optional[tf.Tensor]) -> tf.Tensor:
    """[B, S] foreground logits with padded tokens set to the minimum over the whole batch (the
    reference's masked_fill), so they rank last; float32. padding_mask: [B, S], True = padded."""
    fg_logits = tf.cast(fg_logits, tf.float32)
    if padding_mask is None:
        return fg_logits
    return tf.where(padding_mask, tf.reduce_min(fg_logits), fg_logits)


def select_tokens(scores: tf.Tensor, k: int) -> tf.Tensor:
    """The k highest-scoring tokens of each image, best first: [B, S] -> [B, k] int32.

    Ties rank the lower token index first (tf.math.top_k's documented rule, kept by XLA), so
    the order is total and layer l's top-K_l is the first K_l of layer 0's top-K_0. The
    reference's torch.topk leaves the order of ties unspecified.
    """
    return tf.math.top_k(scores, k=k, sorted=True).indices


def sparse_update(x: tf.Tensor, indices: tf.Tensor, fn: Callable[..., tf.Tensor],
                  *per_token: tf.Tensor, count: Optional[tf.Tensor] = None) -> tf.Tensor:
    """Updates the selected tokens with fn and leaves every other token bit-identical.

        x_out[b, indices[b, k]] = fn(x[b, indices[b]], *per_token[b, indices[b]])[k]
            for k < count[b];  x_out[b, s] = x[b, s] elsewhere.

    Gather and `tf.tensor_scatter_nd_update` over the static [B, K] indices, no boolean mask, so
    XLA keeps static shapes; slots k >= count[b] scatter their own gathered value back. The
    indices of one image must be distinct (top-k's are).

    Args:
      x: [B, S, d] tokens.
      indices: [B, K] int token indices.
      fn: (tokens [B, K, d], *gathered per_token) -> [B, K, d], e.g. an encoder layer on the
        selected tokens with their position embeddings and reference points.
      per_token: tensors [B, S, ...] gathered along S with x (position embedding [B, S, d],
        reference points [B, S, L, 2], scores [B, S]).
      count: [B] int, the slots to write back per image (None: all K).

    Returns:
      [B, S, d], x's dtype.
    """
    indices = tf.cast(indices, tf.int32)
    tokens = tf.gather(x, indices, batch_dims=1)  # [B, K, d]
    gathered = [tf.gather(t, indices, batch_dims=1) for t in per_token]
    updated = tf.cast(fn(tokens, *gathered), x.dtype)  # [B, K, d]
    if count is not None:
        slot = tf.range(tf.shape(indices)[1])[None]  # [1, K]
        write = slot < tf.cast(count, tf.int32)[:, None]  # [B, K]
        updated = tf.where(write[..., None], updated, tokens)
    batch = tf.broadcast_to(tf.range(tf.shape(indices)[0])[:, None], tf.shape(indices))
    return tf.tensor_scatter_nd_update(x, tf.stack([batch, indices], -1), updated)  # [B, S, d]


def multi_category_scores(class_logits: tf.Tensor, fg_scores: tf.Tensor) -> tf.Tensor:
    """The reference's multi-category score of the selected tokens: [B, K] float32.

        score = max_c class_logits[..., c] * fg_scores

    class_logits: [B, K, C] from the two-stage class head (the reference shares it across all
    encoder layers); fg_scores: [B, K], the selection scores gathered. Both are logits, not
    probabilities, as in the reference. Each encoder layer's self-attention step ("OESM") then
    takes the top 300 of these (`select_tokens`).
    """
    return tf.reduce_max(tf.cast(class_logits, tf.float32), -1) * tf.cast(fg_scores, tf.float32)


class MaskPredictor(tf_keras.layers.Layer):
    """The per-token foreground score network: [B, N, d] -> [B, N, 1] logits.

        z = GELU(Dense_h(LayerNorm(x)));  z = [z_local, mean_N(z_global)]  (halves of h)
        logit = Dense_1(GELU(Dense_h/4(GELU(Dense_h/2(z)))))

    The global half is averaged over the level's N tokens, padded ones included (the
    reference's), or over the real ones only when `padding_mask` is given. GELU is erf-exact.
    Sublayer names follow the reference's `layer1.{0,1}`, `layer2.{0,2,4}`.
    """

    def __init__(self, hidden_dim: int = 256, **kwargs):
        super().__init__(**kwargs)
        if hidden_dim % 4:
            raise ValueError(f"MaskPredictor: hidden_dim={hidden_dim} must be a multiple of 4")
        self.hidden_dim = hidden_dim
        self.norm = layer_norm("layer1.0")
        self.linear1 = tf_keras.layers.Dense(hidden_dim, name="layer1.1")
        self.linear2 = tf_keras.layers.Dense(hidden_dim // 2, name="layer2.0")
        self.linear3 = tf_keras.layers.Dense(hidden_dim // 4, name="layer2.2")
        self.linear4 = tf_keras.layers.Dense(1, name="layer2.4")

    def call(self, x: tf.Tensor, padding_mask: Optional[tf.Tensor] = None) -> tf.Tensor:
        """x: [B, N, d]; padding_mask: [B, N] True = padded, or None -> [B, N, 1]."""
        z = gelu_erf(self.linear1(self.norm(x)))  # [B, N, h]
        local, glob = tf.split(z, 2, -1)
        if padding_mask is None:
            glob = tf.reduce_mean(glob, 1, keepdims=True)  # [B, 1, h/2]
        else:
            real = tf.cast(~padding_mask, glob.dtype)[..., None]  # [B, N, 1]
            glob = tf.math.divide_no_nan(tf.reduce_sum(glob * real, 1, keepdims=True),
                                         tf.reduce_sum(real, 1, keepdims=True))
        z = tf.concat([local, tf.broadcast_to(glob, tf.shape(local))], -1)
        return self.linear4(gelu_erf(self.linear3(gelu_erf(self.linear2(z)))))


def align_corners_matrix(n_out: int, n_in: int) -> np.ndarray:
    """[n_out, n_in] float32 rows of 1-d linear interpolation with aligned corners (torch's
    F.interpolate(..., align_corners=True) along one axis): output i samples input position
    i * (n_in - 1) / (n_out - 1), 0 when n_out == 1."""
    m = np.zeros((n_out, n_in), np.float64)
    scale = (n_in - 1) / (n_out - 1) if n_out > 1 else 0.0
    for i in range(n_out):
        src = i * scale
        lo = min(int(np.floor(src)), n_in - 1)
        hi = min(lo + 1, n_in - 1)
        frac = src - lo
        m[i, lo] += 1.0 - frac
        m[i, hi] += frac
    return m.astype(np.float32)


class ForegroundScorer(tf_keras.layers.Layer):
    """Foreground logits of every token, with the reference's top-down modulation.

    Levels run coarsest first. The coarsest level's logits are MaskPredictor(x_{L-1}); every
    finer level l (step i = L-1-l) first becomes

        x_l <- x_l + x_l * up(s_{l+1}) * alpha[i - 1]

    where up() is bilinear upsampling with aligned corners of the coarser level's logit map to
    level l's grid, and alpha [L-1] are learned (uniform in [-0.3, 0.3] at start, the
    reference's; alpha[0] acts on the second-coarsest level). One MaskPredictor serves all
    levels (`enc_mask_predictor`).

    x_l (1 + alpha up) only rescales each token, and the predictor opens with a LayerNorm: the
    modulation changes a score only where 1 + alpha up <= 0 (the token's sign flips) and,
    slightly, through LayerNorm's epsilon. That is the reference's formula, kept as is.

    Args:
      d_model: the tokens' width d, also the predictor's hidden width.
      num_levels: L.
      masked_global: average the predictor's global half over real tokens only (False: over
        all, the reference's; with padding the logits then depend on how much padding there is).
    """

    def __init__(self, d_model: int = 256, num_levels: int = 4, masked_global: bool = False,
                 **kwargs):
        super().__init__(**kwargs)
        self.num_levels = num_levels
        self.masked_global = masked_global
        self.predictor = MaskPredictor(d_model, name="enc_mask_predictor")
        self.alpha = self.add_weight(
            name="alpha", shape=[max(num_levels - 1, 1)], dtype=tf.float32, autocast=False,
            initializer=tf_keras.initializers.RandomUniform(-0.3, 0.3))

    def call(self, memory: tf.Tensor, shapes: Sequence[Tuple[int, int]],
             padding_mask: Optional[tf.Tensor] = None) -> tf.Tensor:
        """memory: [B, S, d], levels flattened row-major, finest first; shapes: static (h, w)
        per level; padding_mask: [B, S] True = padded (used only with masked_global)
        -> [B, S] float32 logits, finest level first (unmasked: the loss's input)."""
        shapes = [(int(h), int(w)) for h, w in shapes]
        if len(shapes) != self.num_levels:
            raise ValueError(f"ForegroundScorer: num_levels={self.num_levels} but shapes has "
                             f"{len(shapes)} levels: {shapes}")
        starts = np.cumsum([0] + [h * w for h, w in shapes])
        scores, prev = [None] * len(shapes), None
        for i, lvl in enumerate(reversed(range(len(shapes)))):
            h, w = shapes[lvl]
            x = memory[:, starts[lvl]:starts[lvl + 1]]  # [B, hw, d]
            if prev is not None:
                ph, pw = shapes[lvl + 1]
                up = tf.einsum("hi,bij,wj->bhw", align_corners_matrix(h, ph),
                               prev, align_corners_matrix(w, pw))  # [B, h, w]
                up = tf.cast(tf.reshape(up, [-1, h * w, 1]), x.dtype)
                x = x + x * up * tf.cast(self.alpha[i - 1], x.dtype)
            mask = None
            if self.masked_global and padding_mask is not None:
                mask = padding_mask[:, starts[lvl]:starts[lvl + 1]]
            s = tf.cast(self.predictor(x, mask)[..., 0], tf.float32)  # [B, hw]
            scores[lvl] = s
            prev = tf.reshape(s, [-1, h, w])
        return tf.concat(scores, 1)  # [B, S]
