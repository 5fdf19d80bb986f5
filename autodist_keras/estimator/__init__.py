"""autodist_keras.estimator."""
