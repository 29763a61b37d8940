// placeholder replaced by the kernels implementation
#include "kernels.h"
