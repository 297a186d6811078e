// The emulator's runtime (cuda_emu.h): fibers, the barrier scheduler, launches.
//
// A fiber is made once (makecontext, its own stack) and lives for the process: it runs the
// kernel body for one thread of a block, parks as DONE, and is resumed for the next block or
// launch, so a launch makes no context and no system call.  A fiber starts with setcontext;
// after that the fibers and the scheduler switch with _setjmp / _longjmp, which save no signal
// mask (swapcontext makes a sigprocmask system call at every switch, and under ASan clears the
// shadow of the whole target stack).  Under ASan each switch is announced to it
// (__sanitizer_start_switch_fiber / finish_switch_fiber), so it knows which stack runs, and
// goes through libc's own _longjmp: ASan's interceptor would unpoison the stack left (a system
// call and a shadow memset per switch) for frames that are not abandoned, only parked.
// (_FORTIFY_SOURCE's longjmp check refuses jumps between stacks, so it is off in this file.)
//
// EMU_REVERSE=1 runs the threads of a block, and the blocks of a grid, in the reverse order.
#undef _FORTIFY_SOURCE
#include <setjmp.h>

#include <memory>
#include <unordered_map>

#include "cuda_emu.h"
#if defined(__SANITIZE_ADDRESS__)
#include <dlfcn.h>
#include <sanitizer/common_interface_defs.h>
#endif
uint3_ threadIdx, blockIdx;
dim3 gridDim, blockDim;
int emu_err;
size_t emu_smem_limit;
float *emu_smem;
uint64_t emu_xbuf[32][32];
unsigned emu_xmask[32];
int emu_pred_acc, emu_pred_sum;
namespace {
enum { RUN, WAIT0, WAIT1, DONE };
constexpr size_t kStack = 256 * 1024;
struct Fiber {
  ucontext_t ctx; // never moved: glibc's ucontext_t points into itself
  jmp_buf jb;
  std::vector<char> stack;
  int state;
  bool started;
};
std::vector<std::unique_ptr<Fiber>> fibers; // grows to the largest block, never shrinks
jmp_buf sched_jb;
int cur;
std::function<void()> *body;
uint64_t block_serial;                         // one per block run, for emu_poison
std::unordered_map<void *, uint64_t> poisoned; // a static __shared__ array -> the block it was poisoned for
#if defined(__SANITIZE_ADDRESS__)
const void *sched_bottom; // the scheduler's stack (the thread's), learnt at the first switch
size_t sched_size;
void leaving(const void *bottom, size_t size) { __sanitizer_start_switch_fiber(nullptr, bottom, size); }
// libc's _longjmp, found once before any switch.  Every switch calls it straight from the
// function that called _setjmp: a frame left by a jump is never resumed, so it must not be an
// instrumented one (ASan would find its redzones later, stale, under another frame).
typedef void (*longjmp_fn)(jmp_buf, int);
longjmp_fn real_longjmp() {
  void *libc = dlopen("libc.so.6", RTLD_LAZY | RTLD_NOLOAD);
  void *f = libc ? dlsym(libc, "_longjmp") : nullptr;
  if (!f) {
    fprintf(stderr, "emu: libc's _longjmp not found (%s)\n", dlerror());
    abort();
  }
  return (longjmp_fn)f;
}
const longjmp_fn jump = real_longjmp();
void arrived_in_fiber() { __sanitizer_finish_switch_fiber(nullptr, &sched_bottom, &sched_size); }
void arrived_in_scheduler() { __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr); }
#else
void leaving(const void *, size_t) {}
#define jump _longjmp
void arrived_in_fiber() {}
void arrived_in_scheduler() {}
const void *sched_bottom;
size_t sched_size;
#endif
void to_scheduler() { // from the running fiber; returns when the scheduler resumes it
  if (!_setjmp(fibers[cur]->jb)) {
    leaving(sched_bottom, sched_size);
    jump(sched_jb, 1);
  }
  arrived_in_fiber();
}
void to_fiber(int t) { // from the scheduler, until the fiber waits or ends
  Fiber &f = *fibers[t];
  if (_setjmp(sched_jb)) {
    arrived_in_scheduler();
    return;
  }
  leaving(f.stack.data(), f.stack.size());
  if (!f.started) {
    f.started = true;
    setcontext(&f.ctx);
  }
  jump(f.jb, 1);
}
void entry() { // a fiber's whole life: one thread of a block per turn
  arrived_in_fiber();
  for (;;) {
    (*body)();
    fibers[cur]->state = DONE;
    to_scheduler(); // resumed for a thread of a later block
  }
}
void grow(int n) {
  while ((int)fibers.size() < n) {
    auto f = std::make_unique<Fiber>();
    f->stack.resize(kStack);
    getcontext(&f->ctx);
    f->ctx.uc_stack.ss_sp = f->stack.data();
    f->ctx.uc_stack.ss_size = f->stack.size();
    f->ctx.uc_link = nullptr;
    makecontext(&f->ctx, entry, 0);
    f->state = DONE;
    f->started = false;
    fibers.push_back(std::move(f));
  }
}
[[noreturn]] void die(const char *what, unsigned x, unsigned y, unsigned z) {
  fprintf(stderr, "emu: %s (block %u,%u,%u)\n", what, x, y, z);
  abort();
}
// Runs the n threads of the current block until all are done, releasing barriers.  (The
// scheduler is not what the sanitizers are for: uninstrumented, it costs a third as much.)
__attribute__((no_sanitize("address", "undefined"))) void run_block(int n, bool rev) {
  const unsigned bx = blockIdx.x, by = blockIdx.y, bz = blockIdx.z;
  const unsigned dx = blockDim.x, dy = blockDim.y;
  emu_pred_acc = 0;
  for (int t = 0; t < n; t++) fibers[t]->state = RUN;
  for (;;) {
    bool any = false;
    for (int t0 = 0; t0 < n; t0++) {
      int t = rev ? n - 1 - t0 : t0;
      if (fibers[t]->state == RUN) {
        cur = t, threadIdx = {t % dx, t / dx % dy, t / (dx * dy)};
        to_fiber(t);
        any = true;
      }
    }
    if (any) continue;
    /* all blocked or done: release complete barriers */
    int done = 0, w0 = 0;
    for (int t = 0; t < n; t++) done += fibers[t]->state == DONE, w0 += fibers[t]->state == WAIT0;
    if (done == n) return;
    bool released = false;
    for (int w = 0; w < n / 32; w++) { /* a warp whose lanes of the mask all wait at a shuffle */
      unsigned at1 = 0, gone = 0, at0 = 0;
      for (int l = 0; l < 32; l++) {
        int s = fibers[w * 32 + l]->state;
        at1 |= (unsigned)(s == WAIT1) << l, gone |= (unsigned)(s == DONE) << l, at0 |= (unsigned)(s == WAIT0) << l;
      }
      if (!at1) continue;
      unsigned mask = emu_xmask[w];
      if (mask & gone) die("a shuffle's mask names lanes that have exited", bx, by, bz);
      if (mask & at0) die("divergent shuffle/syncthreads in a warp", bx, by, bz);
      if ((at1 & mask) == mask) {
        for (int l = 0; l < 32; l++)
          if (at1 >> l & 1) fibers[w * 32 + l]->state = RUN;
        released = true;
      }
    }
    if (released) continue;
    if (w0 + done == n && w0 > 0) {
      if (done) die("__syncthreads after some threads exited", bx, by, bz);
      for (int t = 0; t < n; t++) fibers[t]->state = RUN;
      emu_pred_sum = emu_pred_acc, emu_pred_acc = 0;
      continue;
    }
    die("deadlock", bx, by, bz);
  }
}
} // namespace
void emu_bad_shuffle(const char *what) {
  fprintf(stderr, "emu: %s (block %u,%u,%u, thread %u,%u,%u)\n", what, blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x,
          threadIdx.y, threadIdx.z);
  abort();
}
void emu_wait(int kind) {
  fibers[cur]->state = kind ? WAIT1 : WAIT0;
  to_scheduler();
}
void emu_poison(void *p, size_t n) {
  uint64_t &at = poisoned[p];
  if (at == block_serial) return;
  at = block_serial;
  std::memset(p, 0xff, n);
}
void emu_launch(dim3 g, dim3 b, size_t smem, std::function<void()> f) {
  unsigned nt = b.x * b.y * b.z;
  if (!nt || nt % 32 || nt > 1024 || b.z > 64 || !g.x || !g.y || !g.z || g.y > 65535 || g.z > 65535) {
    fprintf(stderr, "emu: bad launch: grid %u,%u,%u block %u,%u,%u\n", g.x, g.y, g.z, b.x, b.y, b.z);
    emu_err = 1;
    return;
  }
  if (smem > 48 * 1024 && smem > emu_smem_limit) {
    fprintf(stderr, "emu: smem %zu over the limit\n", smem);
    emu_err = 1;
    return;
  }
  if (smem > 227 * 1024) {
    fprintf(stderr, "emu: smem %zu over 227 KB\n", smem);
    emu_err = 1;
    return;
  }
  static const bool rev = getenv("EMU_REVERSE") != nullptr && *getenv("EMU_REVERSE");
  gridDim = g, blockDim = b;
  std::vector<float> buf(smem / 4 + 1);
  body = &f;
  int n = (int)nt;
  grow(n);
  uint64_t nb = (uint64_t)g.x * g.y * g.z;
  for (uint64_t i0 = 0; i0 < nb; i0++) {
    uint64_t i = rev ? nb - 1 - i0 : i0;
    blockIdx = {(unsigned)(i % g.x), (unsigned)(i / g.x % g.y), (unsigned)(i / ((uint64_t)g.x * g.y))};
    block_serial++;
    std::fill(buf.begin(), buf.end(), NAN);
    emu_smem = buf.data();
    run_block(n, rev);
  }
  emu_smem_limit = 0;
}
