"""autodist_keras.devices."""
