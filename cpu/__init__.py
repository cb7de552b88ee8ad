"""CPU kernels: paged attention that reads K/V in place in the pool (cpu/paged_attention.cpp),
built at first use by cpu/extension.py; common/model/paged_attention.py falls back to torch without them."""
