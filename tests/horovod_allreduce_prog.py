"""Run under horovodrun by tests/test_horovod.py: each rank checks all-reduce and broadcast."""
import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()
x = tf.fill([3], float(rank + 1))
summed = hvd.allreduce(x, op=hvd.Sum).numpy()
averaged = hvd.allreduce(x, op=hvd.Average).numpy()
# Independent reference: 1 + 2 + ... + size.
expected_sum = size * (size + 1) / 2
assert np.allclose(summed, expected_sum), (rank, summed)
assert np.allclose(averaged, expected_sum / size), (rank, averaged)
root_value = hvd.broadcast(tf.constant([10.0 * (rank + 1)]), root_rank=0).numpy()
assert np.allclose(root_value, 10.0), (rank, root_value)
print(f"rank {rank}/{size} ok sum={summed[0]} avg={averaged[0]}", flush=True)
