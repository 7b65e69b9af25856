"""What every family's Triton host shares: ``launch`` (launch records, allocation, the prepared problem, row
norms), ``configs`` (launch configurations), ``panel`` (panel sizing, the epilogue GEMM's launch, the GEMM probes),
``target`` (the linear terms' row kernels). A family imports these, never another family."""
