"""autodist_keras.backends."""
