// The emulator's runtime (cuda_emu.h): fibers, the barrier scheduler, launches.
#include "cuda_emu.h"
uint3_ threadIdx, blockIdx;
dim3 gridDim, blockDim;
int emu_err;
size_t emu_smem_limit;
float *emu_smem;
float emu_xbuf[32][32];
namespace {
enum { RUN, WAIT0, WAIT1, DONE };
struct Fiber { ucontext_t ctx; std::vector<char> stack; int state; };
std::vector<Fiber> fibers;
ucontext_t sched;
int cur;
std::function<void()> *body;
void entry() {
  (*body)();
  fibers[cur].state = DONE;
  swapcontext(&fibers[cur].ctx, &sched);
}
}
void emu_wait(int kind) {
  fibers[cur].state = kind ? WAIT1 : WAIT0;
  swapcontext(&fibers[cur].ctx, &sched);
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
    }
    for (;;) {
      bool any = false;
      static int rev = getenv("EMU_REVERSE") != nullptr;
      for (int t0 = 0; t0 < n; t0++) {
        int t = rev ? n - 1 - t0 : t0;
        if (fibers[t].state == RUN) {
          cur = t, threadIdx = {t % b.x, t / b.x % b.y, t / (b.x * b.y)};
          swapcontext(&sched, &fibers[t].ctx);
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
