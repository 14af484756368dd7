"""The retraining pipeline as plain functions (train, calibrate, evaluate, profile SPS) and held-out evaluation."""
