"""A run directory's model as the evaluation tools load it."""
import gin

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
