/* The compute throttle's hooks (tpcore/throttle.h): a throttled kernel call is
 *   double t0 = tp_throttle_begin();     (< 0: the throttle is off, nothing to do)
 *   ... the kernel (on a GPU: its stream waited for) ...
 *   if (t0 >= 0) tp_throttle_end(t0);    (sleeps (factor - 1) x the elapsed time) */
#ifndef TPCORE_THROTTLE_IMPL_H
#define TPCORE_THROTTLE_IMPL_H

#include "tpcore/throttle.h"

double tp_throttle_begin(void);
void tp_throttle_end(double t0);

#endif
