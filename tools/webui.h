/* tools/webui.h - loom serve's chat page (tools/webui.html, compiled in) */
#ifndef LOOM_TOOLS_WEBUI_H
#define LOOM_TOOLS_WEBUI_H

#include <microhttpd.h>

/* Queues the chat page as con's 200 response, with a fresh nonce in it and in its
 * Content-Security-Policy (which admits that page's own script and style, and requests to this
 * server only). */
enum MHD_Result webui_send(struct MHD_Connection *con);

#endif
