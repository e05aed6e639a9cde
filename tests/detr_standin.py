"""A tiny stand-in for the DETR model, following the model contract, for evaluation tests."""
import tensorflow as tf
import tf_keras

NUM_QUERIES, NUM_CLASSES = 6, 4


class StandInDetr(tf_keras.Model):
    """Follows the model contract with a few layers whose outputs depend on image and mask."""

    def __init__(self):
        super().__init__()
        self.conv = tf_keras.layers.Conv2D(8, 3, strides=4, padding="same", activation="relu")
        self.class_head = tf_keras.layers.Dense(NUM_QUERIES * (NUM_CLASSES + 1))
        self.box_head = tf_keras.layers.Dense(NUM_QUERIES * 4)

    def call(self, images, pixel_mask, training=False):
        feats = self.conv(images)  # [B, h, w, 8]
        mask = tf.image.resize(tf.cast(pixel_mask, tf.float32)[..., None],
                               tf.shape(feats)[1:3], method="nearest")  # [B, h, w, 1]
        # Masked mean: padding must not leak into the prediction, as in a real DETR.
        pooled = tf.reduce_sum(feats * mask, [1, 2]) / tf.reduce_sum(mask, [1, 2])  # [B, 8]
        # Appending the real-pixel fraction makes boxes depend on the image size, so a wrong
        # mask or canvas in the exported graph would show.
        fraction = tf.reduce_mean(tf.cast(pixel_mask, tf.float32), [1, 2])[:, None]
        pooled = tf.concat([pooled, fraction], -1)
        logits = tf.reshape(self.class_head(pooled), [-1, NUM_QUERIES, NUM_CLASSES + 1])
        boxes = tf.reshape(self.box_head(pooled), [-1, NUM_QUERIES, 4])
        return {"pred_logits": logits, "pred_boxes": tf.sigmoid(boxes), "aux_outputs": []}
