"""Campaign: the candidates and mixes a run measures, the capacity search and its probes, and the recommendation."""
