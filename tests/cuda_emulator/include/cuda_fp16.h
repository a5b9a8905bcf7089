// Stand-in for the CUDA header: nothing from it is used (see cuda_runtime.h here).
#pragma once
