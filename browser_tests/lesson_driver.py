"""Drive one lesson through JupyterLab in a real browser and describe what happened.

`drive_lesson` opens the notebook in a fresh workspace, clears it, runs all cells, then reads
the notebook's own model (outputs, execution counts) and its DOM (rendered widgets). In the
explorer cell (the first code cell that calls `...explorer(`) it presses the first slider's
arrow key a few times: a MutationObserver on that cell's output times each key press to the
last DOM change it caused (the redraw), and a fingerprint of the plot's images says whether the
plot changed. It returns a plain dict (one row of the report); the tests assert on it.
"""
import statistics
import time

from playwright.sync_api import Error as PlaywrightError

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
# Text the widget manager shows instead of a widget that did not (or not yet) render.
WIDGET_TROUBLE = (r"Error displaying widget|Loading widget|model not found|Failed to load model"
                  r"|Click to show javascript error")  # the last: a view whose code failed

NOTEBOOK_READY = """() => {
  const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  return !!(w && w.content && w.sessionContext && w.sessionContext.session &&
            w.sessionContext.session.kernel && w.sessionContext.kernelDisplayStatus === 'idle');
}"""

START_RUN_ALL = """async () => {
  const app = window.jupyterapp;
  await app.commands.execute('notebook:clear-all-cell-outputs');
  window.__run = { done: false };
  app.commands.execute('notebook:run-all-cells')
    .then(r => { window.__run = { done: true }; })
    .catch(e => { window.__run = { done: true, error: String(e) }; });
}"""

RUN_STATE = """() => {
  const w = window.jupyterapp.shell.currentWidget;
  const code = [...w.content.model.cells].filter(c => c.type === 'code');
  return { done: window.__run.done, error: window.__run.error || null,
           running: code.filter(c => c.executionState === 'running').length,
           unexecuted: code.filter(c => c.executionCount === null).length,
           kernel: w.sessionContext.kernelDisplayStatus };
}"""

# Errors and widget views from this notebook's model; for each top-level widget output, whether
# its DOM holds a widget view and none of the widget manager's trouble texts (a widget the kernel
# closed counts as rendered: its view was there and hid itself when the model went away).
CENSUS = """(trouble) => {
  const w = window.jupyterapp.shell.currentWidget;
  const out = { errors: [], stderr: 0, widgets: 0, widgets_rendered: 0, widgets_closed: 0,
                widget_trouble: [] };
  const bad = new RegExp(trouble, 'i');
  w.content.widgets.forEach((cell, i) => {
    if (cell.model.type !== 'code') return;
    const outputs = cell.model.outputs.toJSON();
    outputs.forEach((o, k) => {
      if (o.output_type === 'error')
        out.errors.push(`cell ${i}: ${o.ename}: ${String(o.evalue).slice(0, 300)}`);
      if (o.output_type === 'stream' && o.name === 'stderr') out.stderr += 1;
      if (!(o.data && o.data['%s'])) return;
      out.widgets += 1;
      const child = cell.outputArea.widgets[k];
      const node = child && child.node;
      const shown = node && node.querySelector('.jp-OutputArea-output');
      const text = shown ? shown.textContent.replace(/\\s+/g, ' ').trim() : '';
      // a widget the kernel closed (a finished progress bar): its view hides itself
      const hidden = node && node.querySelector('.jp-OutputArea-output.lm-mod-hidden');
      if (o.data['%s'].model_id === '' || (hidden && !bad.test(text))) {
        out.widgets_closed += 1; out.widgets_rendered += 1;
      } else if (node && node.querySelector('.jupyter-widgets') && !bad.test(text) &&
                 !node.querySelector('.jupyter-widgets-error-widget'))
        out.widgets_rendered += 1;
      else out.widget_trouble.push(`cell ${i}: ${text.slice(0, 120) || 'nothing shown'}`);
    });
  });
  return out;
}""" % (WIDGET_MIME, WIDGET_MIME)

# Mark the explorer cell (id), scroll to it; its index, or -1 when the lesson has none.
FIND_EXPLORER = """() => {
  const w = window.jupyterapp.shell.currentWidget;
  const cells = [...w.content.model.cells];
  const i = cells.findIndex(c => c.type === 'code' &&
                                 /explorer\\(/.test(c.sharedModel.getSource()));
  if (i < 0) return -1;
  w.content.activeCellIndex = i;
  w.content.scrollToItem(i, 'start');
  w.content.widgets[i].node.id = 'explorer-cell';
  return i;
}"""

# A digest of what the plot looks like: image sources, canvas pixels and SVG markup in the
# explorer's output, outside the controls and JupyterLab's own icons.
PLOT_FINGERPRINT = """() => {
  const area = document.querySelector('#explorer-cell .jp-OutputArea');
  const parts = [];
  for (const e of area.querySelectorAll('img, canvas, svg')) {
    if (e.closest('.widget-slider, .widget-dropdown, .widget-toggle-buttons, ' +
                  '.widget-button, .jp-OutputArea-promptOverlay')) continue;
    if (e.tagName === 'IMG') parts.push(e.src);
    else if (e.tagName === 'CANVAS') parts.push(e.toDataURL());
    else parts.push(e.outerHTML);
  }
  const text = parts.join('|');
  let h = 2166136261;                        // FNV-1a: a short digest, not the whole image
  for (let i = 0; i < text.length; i++) h = Math.imul(h ^ text.charCodeAt(i), 16777619);
  return `${parts.length}:${text.length}:${(h >>> 0).toString(16)}`;
}"""

# A MutationObserver on the explorer's output; t0 is the moment the next key goes down.
ARM_OBSERVER = """() => {
  const area = document.querySelector('#explorer-cell .jp-OutputArea');
  window.__mut = { t0: null, last: null, count: 0 };
  if (window.__obs) window.__obs.disconnect();
  window.__obs = new MutationObserver(() => {
    window.__mut.last = performance.now(); window.__mut.count += 1; });
  window.__obs.observe(area, { subtree: true, childList: true, attributes: true,
                               characterData: true });
  document.addEventListener('keydown', () => { window.__mut.t0 = performance.now(); },
                            { capture: true, once: true });
}"""

MUTATIONS = """() => ({ ...window.__mut, now: performance.now(),
  kernel: window.jupyterapp.shell.currentWidget.sessionContext.kernelDisplayStatus })"""

SLIDER = "#explorer-cell .widget-slider"


def _wait_run_all(page, timeout_s):
    """Poll the notebook until run-all has finished; (seconds, final state)."""
    start = time.monotonic()
    page.evaluate(START_RUN_ALL)
    while True:
        page.wait_for_timeout(500)
        state = page.evaluate(RUN_STATE)
        seconds = time.monotonic() - start
        if state["done"] and state["running"] == 0 and state["kernel"] == "idle":
            return seconds, state
        if seconds > timeout_s:
            state["timed_out"] = True
            return seconds, state


def _census(page, wait_s=20):
    """The census, waiting up to `wait_s` for widgets still on their way to the screen."""
    deadline = time.monotonic() + wait_s
    while True:
        census = page.evaluate(CENSUS, WIDGET_TROUBLE)
        if census["widgets_rendered"] == census["widgets"] or time.monotonic() > deadline:
            return census
        page.wait_for_timeout(500)


def _one_step(page, key, quiet_ms, before_plot, timeout_s=30):
    """Press `key` on the focused slider; wait for the plot to change (or time out) and for the
    output to stay still `quiet_ms`; the ms from key down to the last DOM change, or None."""
    page.evaluate(ARM_OBSERVER)
    page.keyboard.press(key)
    start = time.monotonic()
    while True:
        page.wait_for_timeout(100)
        m = page.evaluate(MUTATIONS)
        changed = page.evaluate(PLOT_FINGERPRINT) != before_plot
        settled = (m["last"] is not None and m["now"] - m["last"] > quiet_ms
                   and m["kernel"] == "idle")
        if (changed and settled) or time.monotonic() - start > timeout_s:
            break
        if not changed and time.monotonic() - start > 5 and settled:
            break                                  # only the readout moved: the plot stays
    if m["t0"] is None or m["last"] is None:
        return None
    return round(m["last"] - m["t0"], 1)


def _move_slider(page, row, steps, quiet_ms):
    """Press the first slider's arrow key `steps` times; fill the slider columns of `row`."""
    slider = page.locator(SLIDER).first
    row["slider_found"] = slider.count() > 0
    if not row["slider_found"]:
        return
    handle = page.locator(f"{SLIDER} .noUi-handle, {SLIDER} input[type=range]").first
    readout = page.locator(f"{SLIDER} .widget-readout").first
    row["slider"] = slider.inner_text().strip().replace("\n", " ")
    first_plot = plot = page.evaluate(PLOT_FINGERPRINT)
    row["plot_elements"] = int(first_plot.split(":")[0])
    key, redraws, values = "ArrowRight", [], [readout.inner_text()]
    for _ in range(steps + 1):                    # one spare press if the slider sat at its end
        if len(redraws) == steps:
            break
        handle.focus()
        ms = _one_step(page, key, quiet_ms, plot)
        values.append(readout.inner_text())
        if values[-1] == values[-2]:              # at the end of its range: go the other way
            key = "ArrowLeft" if key == "ArrowRight" else "ArrowRight"
            continue
        redraws.append(ms)
        plot = page.evaluate(PLOT_FINGERPRINT)
    row["slider_values"] = values
    row["redraws_ms"] = redraws
    timed = [ms for ms in redraws if ms is not None]
    row["median_redraw_ms"] = round(statistics.median(timed), 1) if timed else None
    row["slider_changes_plot"] = plot != first_plot


def drive_lesson(page, lab, notebook, workspace, screens, run_timeout_s=300, steps=3,
                 quiet_ms=800):
    """Run `notebook` (a path relative to the project) in `page`; one report row (a dict)."""
    name = notebook.rsplit("/", 1)[-1].removesuffix(".ipynb")
    row = {"lesson": name, "notebook": notebook, "console_errors": []}
    page.on("console", lambda m: m.type == "error" and
            row["console_errors"].append(m.text[:200]))
    try:
        start = time.monotonic()
        page.goto(lab.lab_url(notebook, workspace), timeout=120_000)
        page.wait_for_function(NOTEBOOK_READY, timeout=120_000)
        row["open_s"] = round(time.monotonic() - start, 1)
        seconds, state = _wait_run_all(page, run_timeout_s)
        row["run_s"] = round(seconds, 1)
        row["run_state"] = state
        row.update(_census(page))
        page.screenshot(path=str(screens / f"{name}-run.png"))
        row["explorer_cell"] = page.evaluate(FIND_EXPLORER)
        if row["explorer_cell"] >= 0:
            page.wait_for_timeout(1000)            # let the scroll settle before the pictures
            area = page.locator("#explorer-cell .jp-OutputArea").first
            area.scroll_into_view_if_needed()
            area.screenshot(path=str(screens / f"{name}-explorer-before.png"))
            _move_slider(page, row, steps, quiet_ms)
            area.screenshot(path=str(screens / f"{name}-explorer-after.png"))
    except PlaywrightError as error:
        row["failure"] = str(error).splitlines()[0][:400]
        try:
            page.screenshot(path=str(screens / f"{name}-failure.png"))
        except PlaywrightError:
            pass
    row["console_errors"] = row["console_errors"][:5]
    return row


def problems(row):
    """What is wrong with a lesson's row, in plain words (empty when all is well)."""
    found = []
    if "failure" in row:
        return [f"the browser run failed: {row['failure']}"]
    state = row["run_state"]
    if state.get("timed_out"):
        found.append(f"run-all did not finish in {row['run_s']} s")
    if state["error"]:
        found.append(f"run-all reported: {state['error']}")
    if state["unexecuted"]:
        found.append(f"{state['unexecuted']} code cell(s) never ran")
    found += [f"error output in {e}" for e in row["errors"]]
    found += [f"widget not rendered in {t}" for t in row["widget_trouble"]]
    if row["explorer_cell"] < 0:
        found.append("no explorer cell (a code cell calling ...explorer()")
    elif not row["slider_found"]:
        found.append("the explorer has no slider")
    elif not row["plot_elements"]:
        found.append("the explorer shows no plot (no image, canvas or SVG in its output)")
    elif not row["slider_changes_plot"]:
        found.append(f"moving the slider ({row['slider_values']}) left the plot unchanged")
    return found
