
document.body.dataset.js = "on";
for (const [id, open] of [["expand-all", true], ["collapse-all", false]]) {
  document.getElementById(id).addEventListener("click", () => {
    document.querySelectorAll("details").forEach((d) => { d.open = open; });
  });
}
