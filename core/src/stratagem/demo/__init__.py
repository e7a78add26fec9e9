"""``stratagem demo``: a small character-level transformer language model trained on text shipped here.

``corpus.txt`` is original prose written for this package (a short story, then sentences assembled from a small
grammar), free to use like the rest of the package.
"""
