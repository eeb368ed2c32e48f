"""GPU code of moestream: Triton kernels that compute on ggml blocks as stored (:mod:`moestream.gpu.tkernels`)."""
