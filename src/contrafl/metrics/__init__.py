"""What the round loop measures: a model's accuracy and loss on data, the weighted kNN
accuracy of its representation, and the statistics of a run's history. Below the
engine, which imports them; the experiments that run and read runs are above it
(:mod:`contrafl.experiments`)."""
