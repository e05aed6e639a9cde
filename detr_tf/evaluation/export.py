"""SavedModel export: raw images in, top detections in original-image pixels out.

`DetectionModule` wraps a model that follows the detr_tf contract
(`model(images, pixel_mask, training=False)` -> {'pred_logits', 'pred_boxes', ...}) with
preprocessing, `postprocess` and `select_top_detections`. It has two serving functions:

    serving_default(encoded: tf.string [N])             JPEG / PNG / BMP / GIF bytes
    serving_images(images: tf.uint8 [N, H, W, 3])        one batch of same-sized RGB images

and, when built with a `fixed_input_size`, a third for runtimes that need static shapes
(TFLite, ONNX; fixed_input.py):

    serving_fixed(images: tf.uint8 [1, H, W, 3], image_size: tf.int32 [1, 2])

All return
    boxes:          [N, K, 4] float32 x0, y0, x1, y1 in original-image pixels, clipped to the image
    scores:         [N, K] float32, sorted decreasing
    classes:        [N, K] int32 class indices (DatasetInfo.category_ids maps them to the
                    dataset's category ids)
    num_detections: [N] int32; entries at index >= num_detections are padding
                    (score 0, box 0, class -1)
with K = max_detections. The same module is what `predict.py` runs, so predictions and the
exported model agree by construction.

Preprocessing is injected: `preprocess_fn` maps ONE uint8 image [H, W, 3] to
(image float32 [Hc, Wc, 3], pixel_mask bool [Hc, Wc]) on a fixed canvas Hc x Wc, e.g. the eval
pipeline's own resize/normalize/pad. Boxes come back in original pixels because the model
predicts them relative to the unpadded resized image, which is the original up to scale.
"""
import json
import os
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import gin
import tensorflow as tf

from detr_tf.evaluation import postprocess as pp
from detr_tf import arg_checks as ac, run as run_lib
from detr_tf.data import augment
from detr_tf.evaluation import fixed_input, preprocess, restore

PreprocessFn = Callable[[tf.Tensor], Tuple[tf.Tensor, tf.Tensor]]

SERVING_DEFAULT = "serving_default"
SERVING_IMAGES = "serving_images"


@gin.configurable(module="detr_tf.evaluation")
def make_resize_pad_preprocess(shorter_side: int = 800,
                               max_size: int = 1333,
                               canvas_size: Optional[Sequence[int]] = None) -> PreprocessFn:
    """The default preprocessing: the eval pipeline's with its sizes given here.

    The eval resize's rule (`augment.resized_shape`, the reference DETR's: the shorter side to
    `shorter_side`, the other floored, the longer capped at `max_size`), bilinear, then its
    ImageNet normalization (`augment.normalize_image`) and padding onto a fixed canvas
    (`preprocess.canvas_preprocess_fn`). A run's export takes its own bound eval transform
    instead (`preprocess.eval_preprocess_fn`).

    Args:
      shorter_side: S, target length of the shorter side.
      max_size: L, cap on the longer side.
      canvas_size: (Hc, Wc) padded output size, each >= max_size; default (L, L), which fits
        every aspect ratio.

    Returns:
      A function: uint8 image [H, W, 3] -> (float32 [Hc, Wc, 3] normalized, zero padding at the
      bottom/right; bool [Hc, Wc] pixel_mask, True on real pixels).
    """
    canvas_h, canvas_w = canvas_size if canvas_size is not None else (max_size, max_size)
    if canvas_h < max_size or canvas_w < max_size:
        raise ValueError(f"make_resize_pad_preprocess: canvas_size={tuple(canvas_size)} is "
                         f"smaller than max_size={max_size}; a resized image would not fit")
    def resize(image: tf.Tensor) -> tf.Tensor:
        image = tf.cast(tf.ensure_shape(image, [None, None, 3]), tf.float32)
        return augment.resize(image, tf.zeros([0, 4]), shorter_side, max_size)[0]

    return preprocess.canvas_preprocess_fn(resize, (canvas_h, canvas_w))


def _canvas_specs(preprocess_fn: PreprocessFn) -> Tuple[tf.TensorSpec, tf.TensorSpec]:
    """Traces `preprocess_fn` once to read (and check) its static output shapes."""
    traced = tf.function(preprocess_fn).get_concrete_function(
        tf.TensorSpec([None, None, 3], tf.uint8))
    outputs = traced.structured_outputs
    if not isinstance(outputs, (tuple, list)) or len(outputs) != 2:
        raise ValueError(f"DetectionModule: preprocess_fn must return (image, pixel_mask), "
                         f"got {outputs!r}")
    image, mask = outputs
    hc_wc = image.shape[:2]
    if (image.shape.rank != 3 or image.shape[2] != 3 or not hc_wc.is_fully_defined()
            or image.dtype != tf.float32 or mask.dtype != tf.bool or mask.shape != hc_wc):
        raise ValueError(
            f"DetectionModule: preprocess_fn must map a uint8 [H, W, 3] image to float32 "
            f"[Hc, Wc, 3] and bool [Hc, Wc] with a static canvas Hc x Wc; it returned "
            f"{image.dtype.name} {image.shape} and {mask.dtype.name} {mask.shape}")
    return tf.TensorSpec(image.shape, tf.float32), tf.TensorSpec(mask.shape, tf.bool)


class DetectionModule(tf.Module):
    """A model plus pre- and post-processing, what `export_saved_model` saves and `predict` runs.

    Args:
      model: a tf_keras.Model called as `model(images, pixel_mask, training=False)` returning
        'pred_logits' [B, Q, C + 1] and 'pred_boxes' [B, Q, 4] (normalized cx, cy, w, h).
      preprocess_fn: uint8 [H, W, 3] -> (float32 [Hc, Wc, 3], bool [Hc, Wc]); default
        `make_resize_pad_preprocess()`.
      max_detections: K, detections returned per image.
      score_threshold: detections scoring lower are dropped (become padding).
      jit_compile: compile the model + postprocess step with XLA.
      fixed_input_size: (H, W): add `serve_fixed` (the `serving_fixed` signature) for one
        image of that size; None: no such signature.
      num_classes: the data's classes: a class head that does not fit the bound
        post-processing is refused here, as evaluation refuses it
        (`postprocess.check_class_head`; the model is traced once for it); None: not checked.
    """

    def __init__(self,
                 model: tf.Module,
                 preprocess_fn: Optional[PreprocessFn] = None,
                 max_detections: int = 100,
                 score_threshold: float = 0.0,
                 jit_compile: bool = False,
                 fixed_input_size: Optional[Sequence[int]] = None,
                 num_classes: Optional[int] = None,
                 name: Optional[str] = None):
        super().__init__(name=name)
        self.model = model
        self._preprocess_fn = preprocess_fn or make_resize_pad_preprocess()
        self._canvas_specs = _canvas_specs(self._preprocess_fn)
        self._max_detections = int(max_detections)
        self._score_threshold = float(score_threshold)
        self._num_classes = num_classes
        self._detect_fn = tf.function(self.detect_preprocessed, jit_compile=jit_compile)
        self.serve_encoded = tf.function(
            self._serve_encoded,
            input_signature=[tf.TensorSpec([None], tf.string, name="encoded")])
        self.serve_images = tf.function(
            self._serve_images,
            input_signature=[tf.TensorSpec([None, None, None, 3], tf.uint8, name="images")])
        self.serve_fixed = None
        if fixed_input_size is not None:
            self.serve_fixed = fixed_input.fixed_signature(
                self.detect_preprocessed, self._preprocess_fn, fixed_input_size)
        if num_classes is not None:
            self._check_class_head()

    def _check_class_head(self) -> None:
        """Traces the detection once, on the canvas: a class head the bound post-processing
        does not fit raises its ValueError here, before any image is read, and not wrapped in
        the serving functions' AutoGraph error."""
        image, mask = self._canvas_specs
        self._detect_fn.get_concrete_function(
            tf.TensorSpec([None] + image.shape.as_list(), image.dtype),
            tf.TensorSpec([None] + mask.shape.as_list(), mask.dtype),
            tf.TensorSpec([None, 2], tf.int32))

    @tf.autograph.experimental.do_not_convert
    def detect_preprocessed(self, images: tf.Tensor, pixel_mask: tf.Tensor,
                             orig_sizes: tf.Tensor) -> Dict[str, tf.Tensor]:
        """[N, Hc, Wc, 3], [N, Hc, Wc], [N, 2] (h, w) -> the serving outputs.

        Traced as written, the model and postprocessing included: they have no Python control
        flow on tensors, and AutoGraph's conversion of every layer only cost time. (A custom
        preprocess_fn is still converted.)"""
        outputs = self.model(images, pixel_mask, training=False)
        dets = pp.postprocess_outputs(outputs, orig_sizes, "xyxy",
                                      num_classes=self._num_classes)
        top = pp.select_top_detections(dets, self._max_detections, self._score_threshold)
        # Served boxes stay inside the image: a predicted box may overhang it (cx +- w/2 is not
        # bounded), which a consumer drawing or cropping should not have to handle. COCO
        # evaluation (coco_eval) keeps the reference's unclipped boxes.
        size = tf.cast(orig_sizes, tf.float32)  # [N, 2] (h, w)
        upper = tf.stack([size[:, 1], size[:, 0], size[:, 1], size[:, 0]], -1)[:, None, :]
        boxes = tf.clip_by_value(top["boxes"], 0.0, upper)  # [N, K, 4] x0, y0, x1, y1
        return {"boxes": boxes, "scores": top["scores"], "classes": top["labels"],
                "num_detections": top["num_detections"]}

    def _preprocess_batch(self, images: tf.Tensor, decode: bool):
        def one(x):
            if decode:
                # expand_animations=False: a GIF gives its first frame as [H, W, 3], like a JPEG.
                x = tf.io.decode_image(x, channels=3, dtype=tf.uint8, expand_animations=False)
            size = tf.shape(x)[:2]  # (h, w) of the original image
            image, mask = self._preprocess_fn(x)
            return image, mask, size

        # The canvas shape is static, so the model sees [N, Hc, Wc, 3] at trace time, as in
        # training (position encodings and XLA both prefer static spatial dims).
        image, mask, sizes = tf.map_fn(
            one, images,
            fn_output_signature=self._canvas_specs + (tf.TensorSpec([2], tf.int32),))
        return image, mask, sizes  # [N, Hc, Wc, 3], [N, Hc, Wc], [N, 2]

    def _serve(self, batch: tf.Tensor, decode: bool) -> Dict[str, tf.Tensor]:
        """The serving outputs for a batch of N >= 0 images: an empty batch gets empty outputs
        (the model itself cannot run on N = 0: its feature masks lose their shapes)."""
        k = self._max_detections
        empty = {"boxes": tf.zeros([0, k, 4]), "scores": tf.zeros([0, k]),
                 "classes": tf.zeros([0, k], tf.int32), "num_detections": tf.zeros([0], tf.int32)}
        return tf.cond(tf.shape(batch)[0] > 0,
                       lambda: self._detect_fn(*self._preprocess_batch(batch, decode)),
                       lambda: empty)

    def _serve_encoded(self, encoded: tf.Tensor) -> Dict[str, tf.Tensor]:
        return self._serve(encoded, decode=True)

    def _serve_images(self, images: tf.Tensor) -> Dict[str, tf.Tensor]:
        return self._serve(images, decode=False)

    def detect(self, images: tf.Tensor) -> Dict[str, tf.Tensor]:
        """Detections for uint8 images [N, H, W, 3] (eager convenience for `serve_images`)."""
        return self.serve_images(tf.convert_to_tensor(images, tf.uint8))

    def detect_encoded(self, encoded: tf.Tensor) -> Dict[str, tf.Tensor]:
        """Detections for encoded images [N] (eager convenience for `serve_encoded`)."""
        return self.serve_encoded(tf.convert_to_tensor(encoded, tf.string))

    def signatures(self) -> Dict[str, tf.types.experimental.ConcreteFunction]:
        """The serving signatures, keyed by their SavedModel names."""
        signatures = {SERVING_DEFAULT: self.serve_encoded.get_concrete_function(),
                      SERVING_IMAGES: self.serve_images.get_concrete_function()}
        if self.serve_fixed is not None:
            signatures[fixed_input.SERVING_FIXED] = self.serve_fixed.get_concrete_function()
        return signatures


EXPORT_RULES = {"max_detections": ac.integer(1),
                "score_threshold": ac.number(0.0, 1.0, high_open=False)}


@gin.configurable(module="detr_tf.evaluation",
                  denylist=["model", "export_dir", "before_write", "num_classes"])
def export_saved_model(model: tf.Module,
                       export_dir: Union[str, os.PathLike],
                       preprocess_fn: Optional[PreprocessFn] = None,
                       max_detections: int = 100,
                       score_threshold: float = 0.0,
                       fixed_input_size: Optional[Sequence[int]] = None,
                       before_write: Optional[Callable[[], None]] = None,
                       num_classes: Optional[int] = None) -> str:
    """Writes a SavedModel with the `serving_default` and `serving_images` signatures.

    Args:
      model: the trained model (see `DetectionModule`).
      export_dir: output directory (created).
      preprocess_fn: see `DetectionModule`; default `make_resize_pad_preprocess()`.
      max_detections: K, detections per image.
      score_threshold: minimum score of a returned detection.
      fixed_input_size: (H, W) of the `serving_fixed` signature (fixed_input.py) that TFLite
        and ONNX are converted from; None: no such signature.
      before_write: called once every signature is traced (a preprocessing the fixed form
        refuses has been refused), before anything is written.
      num_classes: the data's classes: a class head that does not fit the bound
        post-processing is refused before anything is written (`DetectionModule`).

    Returns:
      export_dir as a string. Load with `tf.saved_model.load(export_dir)` and call
      `loaded.signatures['serving_default'](encoded=...)` (outputs keyed as in the module
      docstring) or `loaded.serve_encoded(...)` / `loaded.serve_images(...)`.
    """
    ac.check("export_saved_model", {"max_detections": max_detections,
                                    "score_threshold": score_threshold}, EXPORT_RULES)
    module = DetectionModule(model, preprocess_fn, max_detections, score_threshold,
                             fixed_input_size=fixed_input_size, num_classes=num_classes)
    export_dir = os.fspath(export_dir)
    signatures = module.signatures()  # traced first: a model may create its variables there
    if before_write is not None:
        before_write()
    tf.saved_model.save(_Served(module), export_dir, signatures=signatures)
    return export_dir


class _Served(tf.Module):
    """What the SavedModel holds: a DetectionModule's serving functions and its model's variables.

    Not the Keras model as an object: tf_keras would save each of its layers with call functions
    of their own, traced once more for the purpose and used by no signature. That was most of an
    export's time and two thirds of its saved_model.pb (docs/EXPORT.md#what-the-savedmodel-holds).
    """

    def __init__(self, module: DetectionModule):
        super().__init__()
        self.model_variables = list(module.model.variables)
        self.serve_encoded = module.serve_encoded
        self.serve_images = module.serve_images
        if module.serve_fixed is not None:
            self.serve_fixed = module.serve_fixed


def export_run(model_dir: str, export_dir: str, checkpoint: Optional[str] = None,
               fixed_input_size: Optional[Sequence[int]] = None,
               before_write: Optional[Callable[[], None]] = None) -> str:
    """tools/export.py: a SavedModel of a run's checkpoint with its eval preprocessing inside.

    Args:
      model_dir, checkpoint: the run and (optionally) the checkpoint to export.
      export_dir: where the SavedModel is written.
      fixed_input_size: (H, W) of the `serving_fixed` signature, or 'canvas' for the eval
        canvas's size; None: no such signature.
      before_write: called once the model is restored and its signatures are traced (the
        fixed form's refusals made, and a class head that does not fit the bound
        post-processing refused), before anything is written (a refused export leaves
        export_dir as it was).

    Other export settings (max_detections, score_threshold) come from Gin
    (`export_saved_model.*`).
    """
    # Bindings out of range fail here, before the model is restored.
    ac.check("export_saved_model", gin.get_bindings(export_saved_model), EXPORT_RULES)
    model, path = restore.load_trained_model(model_dir, checkpoint)
    print(f"export: restored {path}", flush=True)
    model = restore.inference_model(model)  # without training-only heads (Co-DINO's)
    info = run_lib.assemble().eval_info()
    preprocess_fn = preprocess.eval_preprocess_fn(info.buckets)
    if fixed_input_size == "canvas":
        fixed_input_size = preprocess_fn.canvas_size
    out = export_saved_model(model, export_dir, preprocess_fn=preprocess_fn,
                             fixed_input_size=fixed_input_size, before_write=before_write,
                             num_classes=info.num_classes)
    names = [SERVING_DEFAULT, SERVING_IMAGES] + (
        [fixed_input.SERVING_FIXED] if fixed_input_size is not None else [])
    print(f"export: wrote SavedModel to {out} (signatures: {', '.join(names)})", flush=True)
    write_labels(os.path.join(export_dir, LABELS_FILENAME), info)
    return out


LABELS_FILENAME = "labels.json"


def write_labels(path: str, info: Any) -> None:
    """The exported `classes` output's meaning: [{"class": index, "category_id": the dataset's
    id, "name": ...}] in index order, from the run's DatasetInfo."""
    labels = [{"class": i, "category_id": int(cid), "name": str(name)}
              for i, (cid, name) in enumerate(zip(info.category_ids, info.class_names))]
    with open(path, "w") as f:
        json.dump(labels, f, indent=1)
    print(f"export: wrote {path} (class index -> category id and name)", flush=True)
