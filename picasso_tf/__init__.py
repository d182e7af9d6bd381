"""picasso_tf: PICASSO's packing, interleaving and caching for Keras recommendation models."""
__version__ = "0.1.0"
