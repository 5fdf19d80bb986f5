"""autodist_keras.fusion."""
