"""A run directory's model as the evaluation tools load it, and a checkpoint's model weights."""
import gin
import tensorflow as tf

from detr_tf import cli
from detr_tf.evaluation import restore


def restore_as_eval_tool(run_dir) -> tuple:
    """(model, checkpoint path) as tools/eval.py loads them: the run's own config.gin, the eval
    model, the latest checkpoint restored. Gin is left cleared."""
    gin.clear_config()
    try:
        cli.parse_tool_config("eval.py", [], [], str(run_dir))
        return restore.load_trained_model(str(run_dir))
    finally:
        gin.clear_config()


def checkpoint_model_weights(ckpt: str) -> dict:
    """{key: value} of the model's variables in a checkpoint (no optimizer slots)."""
    reader = tf.train.load_checkpoint(ckpt)
    return {name: reader.get_tensor(name) for name, _ in tf.train.list_variables(ckpt)
            if name.startswith("model/") and "OPTIMIZER_SLOT" not in name}
