// The sidebar buttons must open the sidebars on every screen.
//
// sphinx-book-theme 1.3.0 and pydata-sphinx-theme 0.17.1 both attach their toggle handlers to the
// first `.primary-toggle` (and `.secondary-toggle`) of the page, found with querySelector. That is
// a button in pydata's own header, which the book layout never shows; the buttons a reader sees, in
// the article's header, got no handler, so the menu button did nothing on a phone or a desktop.
// Each visible button now hands its click to the first one, where both themes' handlers live
// (the book theme hides or shows the sidebar on wide screens, pydata opens it as a dialog on narrow
// ones).
document.addEventListener("DOMContentLoaded", () => {
  for (const selector of [".primary-toggle", ".secondary-toggle"]) {
    const [withHandlers, ...others] = document.querySelectorAll(selector);
    for (const button of others) {
      button.addEventListener("click", (event) => {
        event.preventDefault();
        event.stopPropagation();
        withHandlers.click();
      });
    }
  }
});
