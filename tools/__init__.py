"""Command-line tools: train, profile_graph, bench, gen_data."""
