"""Feature schema, readers, synthetic generators and bundled datasets."""
from picasso_tf.data.schema import CATEGORICAL, DENSE, SEQUENCE, Feature, Schema
