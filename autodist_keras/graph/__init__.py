"""autodist_keras.graph."""
