"""Input pipeline: sources, tf.Example codec, DETR augmentations, canvas buckets, batching.

The trainer's entry points (both Gin-configurable, see pipeline.py):

    build_dataset(is_training, global_batch_size, input_context=None, num_shards=None,
                  shard_index=None, deterministic=False, seed=None,
                  start_batch=0) -> tf.data.Dataset
    dataset_info(is_training) -> DatasetInfo(num_examples, num_classes, class_names,
                                             annotations_file, buckets)

Sources are injected by Gin: gin_configs/data/coco_tfrecord.gin, coco_tfds.gin, shapes.gin.
Modules: tfexample (codec), label_map, sources, augment (DETR's recipe), rtdetr_augment
(RT-DETR's), mixing (mosaic, mixup), stages (their epoch schedule), buckets, pipeline,
coco_converter, shapes (synthetic dataset), benchmark.
"""
