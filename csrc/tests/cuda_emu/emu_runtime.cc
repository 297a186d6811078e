// The emulator's runtime (cuda_emu.h): fibers, the barrier scheduler, launches.
//
// A fiber starts with setcontext on its own stack; after that the fibers and the scheduler switch
// with _setjmp / _longjmp, which save no signal mask: swapcontext makes a sigprocmask system call
// at every switch, half the emulator's time.  Under ASan, which follows stack switches only through
// swapcontext, every switch is a swapcontext.  (_FORTIFY_SOURCE's longjmp check refuses jumps
// between stacks, so it is off in this file.)
#undef _FORTIFY_SOURCE
#include <setjmp.h>
#include "cuda_emu.h"
uint3_ threadIdx, blockIdx;
dim3 gridDim, blockDim;
int emu_err;
size_t emu_smem_limit;
float *emu_smem;
float emu_xbuf[32][32];
namespace {
enum { RUN, WAIT0, WAIT1, DONE };
#if defined(__SANITIZE_ADDRESS__)
constexpr bool fast_switch = false;
#else
constexpr bool fast_switch = true;
#endif
struct Fiber { ucontext_t ctx; jmp_buf jb; std::vector<char> stack; int state; bool started; };
std::vector<Fiber> fibers;
ucontext_t sched;
jmp_buf sched_jb;
int cur;
std::function<void()> *body;
void to_scheduler() {  // from the running fiber
  if (!fast_switch) swapcontext(&fibers[cur].ctx, &sched);
  else if (!_setjmp(fibers[cur].jb)) _longjmp(sched_jb, 1);
}
void to_fiber(int t) {  // from the scheduler, until the fiber waits or ends
  if (!fast_switch) { swapcontext(&sched, &fibers[t].ctx); return; }
  if (_setjmp(sched_jb)) return;
  if (!fibers[t].started) { fibers[t].started = true; setcontext(&fibers[t].ctx); }
  _longjmp(fibers[t].jb, 1);
}
void entry() {
  (*body)();
  fibers[cur].state = DONE;
  if (!fast_switch) swapcontext(&fibers[cur].ctx, &sched);
  _longjmp(sched_jb, 1);  // never returns here: the fiber is not resumed
}
}
void emu_wait(int kind) {
  fibers[cur].state = kind ? WAIT1 : WAIT0;
  to_scheduler();
}
void emu_launch(dim3 g, dim3 b, size_t smem, std::function<void()> f) {
  if (b.x * b.y * b.z % 32 || b.x * b.y * b.z > 1024 || b.z > 64) { emu_err = 1; return; }
  if (smem > 48 * 1024 && smem > emu_smem_limit) { fprintf(stderr, "emu: smem %zu over the limit\n", smem); emu_err = 1; return; }
  if (smem > 227 * 1024) { fprintf(stderr, "emu: smem %zu over 227 KB\n", smem); emu_err = 1; return; }
  gridDim = g, blockDim = b;
  std::vector<float> buf(smem / 4 + 1);
  body = &f;
  int n = (int)(b.x * b.y * b.z), nw = n / 32;
  fibers.resize(n);
  for (auto &fb : fibers) fb.stack.resize(256 * 1024);
  for (unsigned z = 0; z < g.z; z++) for (unsigned y = 0; y < g.y; y++) for (unsigned x = 0; x < g.x; x++) {
    blockIdx = {x, y, z};
    std::fill(buf.begin(), buf.end(), NAN);
    emu_smem = buf.data();
    for (int t = 0; t < n; t++) {
      getcontext(&fibers[t].ctx);
      fibers[t].ctx.uc_stack.ss_sp = fibers[t].stack.data();
      fibers[t].ctx.uc_stack.ss_size = fibers[t].stack.size();
      fibers[t].ctx.uc_link = nullptr;
      makecontext(&fibers[t].ctx, entry, 0);
      fibers[t].state = RUN;
      fibers[t].started = false;
    }
    for (;;) {
      bool any = false;
      static int rev = getenv("EMU_REVERSE") != nullptr;
      for (int t0 = 0; t0 < n; t0++) {
        int t = rev ? n - 1 - t0 : t0;
        if (fibers[t].state == RUN) {
          cur = t, threadIdx = {t % b.x, t / b.x % b.y, t / (b.x * b.y)};
          to_fiber(t);
          any = true;
        }
      }
      if (any) continue;
      /* all blocked or done: release complete barriers */
      int done = 0, w0 = 0;
      for (int t = 0; t < n; t++) done += fibers[t].state == DONE, w0 += fibers[t].state == WAIT0;
      if (done == n) break;
      bool released = false;
      for (int w = 0; w < nw; w++) { /* a warp whose live lanes all wait at a shuffle */
        int live = 0, w1 = 0;
        for (int l = 0; l < 32; l++) { int s = fibers[w * 32 + l].state; live += s != DONE; w1 += s == WAIT1; }
        if (live && w1 == live) { for (int l = 0; l < 32; l++) if (fibers[w * 32 + l].state == WAIT1) fibers[w * 32 + l].state = RUN; released = true; }
        else if (w1 && w1 != live) { /* mixed: a lane at a shuffle, another at __syncthreads */
          bool other = false; for (int l = 0; l < 32; l++) other |= fibers[w * 32 + l].state == WAIT0;
          if (other) { fprintf(stderr, "emu: divergent shuffle/syncthreads in block %u,%u\n", x, y); abort(); }
        }
      }
      if (released) continue;
      if (w0 + done == n && w0 > 0) {
        if (done) { fprintf(stderr, "emu: __syncthreads after some threads exited (block %u,%u)\n", x, y); abort(); }
        for (int t = 0; t < n; t++) if (fibers[t].state == WAIT0) fibers[t].state = RUN;
        continue;
      }
      fprintf(stderr, "emu: deadlock in block %u,%u\n", x, y); abort();
    }
  }
  emu_smem_limit = 0;
}
