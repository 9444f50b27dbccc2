"""`broker bench`: each scenario measured next to its baseline in the same run, on the same database.

Results are medians of several repetitions with their spread, and the ratio to the baseline;
they go to results.json and results.md in the output folder.

The benchmark is not part of the product: it needs the bench extra (pip install 'pg-broker[bench]'),
which a node does not install.
"""
