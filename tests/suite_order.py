"""The order the suite's files start in (tests/conftest.py applies it at collection).

Under `--dist loadfile` a file runs whole on one worker, and a worker takes the next file in
collection order as it runs out of work; started late, the longest file would run alone at the
end. So the longest files are collected first (longest processing time first), and xdist keeps
that order (`--no-loadscope-reorder` in pyproject.toml; by default it orders files by their test
count, and the trainer files have few tests).
"""

# Longest first: every file over 5 s in the per-file sums of `pytest --durations=0` (the default
# set, 2-core AVX-512 CPU, idle). The rest take under 5 s each and fill in behind them, so the
# two workers end within a few seconds of each other.
LONGEST_FILES = ("test_trainer.py", "test_trainer_paths.py", "test_tools_e2e.py",
                 "test_matching.py", "test_co_detr.py", "test_weights.py",
                 "test_steps_per_loop.py", "test_detr.py", "test_matching_init.py",
                 "test_weights_cli.py", "test_ddf_replicas.py", "test_export_eval_parity.py",
                 "test_termination.py", "test_data_pipeline.py", "test_variable_names.py",
                 "test_losses.py", "test_console.py", "test_rtdetr_decoder.py",
                 "test_export_standin.py", "test_finetune_heads.py", "test_rtdetr_weights.py",
                 "test_jit_matcher.py", "test_init_from_ema.py", "test_horovod.py",
                 "test_step_deferred.py", "test_deformable_detr.py", "test_hardware.py",
                 "test_data_shapes.py", "test_gin_bindings.py", "test_fused_adamw.py",
                 "test_predict.py", "test_recipe_references.py", "test_resume.py",
                 "test_matcher_costs.py", "test_benchmark_deformable.py", "test_benchmarks.py",
                 "test_rcnn_head.py", "test_import_configs.py", "test_hybrid_queries.py")


def longest_files_first(items) -> None:
    """Sorts pytest items in place: LONGEST_FILES' tests first, in that order, then the rest as
    collected; each file's tests stay together and in their order (the sort is stable)."""
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
