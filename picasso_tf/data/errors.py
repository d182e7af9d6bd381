"""The error raised for malformed input data."""


class DataFormatError(ValueError):
    """Input data does not match its schema or format.

    Raised directly by checks that run in Python (file headers, Parquet column types,
    in-memory arrays). Checks that run inside a tf.data pipeline surface as
    tf.errors.InvalidArgumentError carrying the same kind of message: the file, the
    line/row/record, the column or feature, the offending value and what to do.
    """
