"""The supervisor around torchrun (elastic restarts, hang detection): not built yet."""
