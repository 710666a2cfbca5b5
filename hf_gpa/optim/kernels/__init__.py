"""The fused kernels of hf_gpa's optimizers and the one rule that picks them.

* ``cpu``: the C++ kernel (``csrc/gpa_adamw.cpp``), built once per environment by torch's loader;
* ``triton_launch``: the multi-tensor Triton launcher (imports only torch), ``triton_source``: the kernels (triton).
"""
