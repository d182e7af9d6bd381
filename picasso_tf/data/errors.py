"""The errors raised for input data that cannot be used, and the line of an error that
their messages quote."""


class DataFormatError(ValueError):
    """Input data does not match its schema or format.

    Raised directly by checks that run in Python (file headers, Parquet column types,
    in-memory arrays). Checks that run inside a tf.data pipeline surface as
    tf.errors.InvalidArgumentError carrying the same kind of message: the file, the
    line/row/record, the column or feature, the offending value and what to do.
    """


class DataFileError(DataFormatError):
    """Data files cannot be used as given: a path names no file, a file cannot be read,
    its format is unknown or differs from the others', or it needs a schema. The
    message names the path and says what to do."""


def first_line(error):
    """The first line of an error's message: TensorFlow's errors append the graph
    context on further lines, which a one-line message leaves out."""
    text = str(getattr(error, "message", None) or error).strip()
    return text.splitlines()[0] if text else type(error).__name__
