/* The stateless half of the library finder (dynlib.h): symbol lookup and a handle's
 * path.  Compiled into the core and into the CUDA plugin alike (the search itself,
 * with its registered directories, stays in the core: dynlib.c). */
#include <dlfcn.h>
#include <link.h>

#include "dynlib.h"

void *tp_dynlib_sym(void *lib, const char *what, const char *symbol) {
  if (!lib || !symbol) {
    tp_set_error(TP_ERR_INVALID_ARGUMENT, "dynlib_sym: no library or symbol");
    return NULL;
  }
  dlerror();
  void *p = dlsym(lib, symbol);
  if (!p)
    tp_set_error(TP_ERR_UNSUPPORTED, "%s at %s has no symbol %s (too old a version?)", what, tp_dynlib_path(lib),
                 symbol);
  return p;
}

const char *tp_dynlib_path(void *lib) {
  struct link_map *map = NULL;
  if (!lib || dlinfo(lib, RTLD_DI_LINKMAP, &map) != 0 || !map || !map->l_name) return "";
  return map->l_name;
}
