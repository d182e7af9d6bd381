"""The model zoo: the PICASSO paper's models in plain Keras (no picasso_tf code inside)."""
