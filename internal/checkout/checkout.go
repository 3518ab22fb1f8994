// Package checkout finds the checkout of this repository, for whatever reads its
// files outside the Go build: the tools hack/tools.sh builds, the rendered
// chart, docs, scripts and the versions tools/ pins. It is the one place
// that knows how; tests, the test kit and the lab ask it.
package checkout

import (
	"bufio"
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"runtime"
	"strings"
)

// Module is the module path the root's go.mod declares; the go.mod files
// under tools/ declare others, so a walk up from inside them does not stop
// there.
const Module = "github.com/harvester-csi/harvester-csi-driver"

// Root returns the absolute path of the checkout: where this source file
// was compiled from, when that is a checkout (every go test and go run), else
// the nearest directory at or above the working directory that is one (a
// binary built with -trimpath, as make lab builds hcsi-lab, run from the
// checkout).
func Root() (string, error) {
	if _, file, _, ok := runtime.Caller(0); ok && filepath.IsAbs(file) {
		if dir := filepath.Join(filepath.Dir(file), "..", ".."); IsRoot(dir) {
			return dir, nil
		}
	}
	wd, err := os.Getwd()
	if err != nil {
		return "", err
	}
	return Above(wd)
}

// Above returns the nearest directory at or above dir whose go.mod declares
// Module.
func Above(dir string) (string, error) {
	dir, err := filepath.Abs(dir)
	if err != nil {
		return "", err
	}
	for {
		if IsRoot(dir) {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("checkout: no go.mod of " + Module + " at or above " + dir + " (run from the checkout)")
		}
		dir = parent
	}
}

// IsRoot reports whether dir holds a go.mod declaring Module.
func IsRoot(dir string) bool {
	data, err := os.ReadFile(filepath.Join(dir, "go.mod"))
	if err != nil {
		return false
	}
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		if f := strings.Fields(sc.Text()); len(f) == 2 && f[0] == "module" {
			return strings.Trim(f[1], `"`) == Module
		}
	}
	return false
}
