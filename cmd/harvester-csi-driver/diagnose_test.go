package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"k8s.io/client-go/rest"

	"github.com/harvester-csi/harvester-csi-driver/pkg/diagnose"
)

// TestDiagnoseHelpListsFlagsAndExitCodes: --help names every flag of the
// command, the way to run it in the chart's pod, and its exit codes.
func TestDiagnoseHelpListsFlagsAndExitCodes(t *testing.T) {
	var out, errOut bytes.Buffer
	if code := runDiagnose(context.Background(), []string{"--help"}, podEnv(), &out, &errOut); code != diagnose.ExitClean {
		t.Fatalf("--help exited %d: %s", code, errOut.String())
	}
	help := out.String()
	for _, want := range []string{"--kubeconfig", "--guest-kubeconfig", "--controller ", "--namespace", "--controller-selector", "-o ", "--output",
		"--slow-after", "--timeout", chartKubeconfig, "deploy/harvester-csi-driver-controllers", diagnose.AttacherLeaseName("driver.harvesterhci.io"),
		"Exit codes:", "  0  no disagreement", "  1  at least one disagreement", "  2  could not look"} {
		if !strings.Contains(help, want) {
			t.Errorf("--help lacks %q:\n%s", want, help)
		}
	}
}

// TestDiagnoseDefaultsToTheChartsKubeconfig: with no --kubeconfig, diagnose
// reads the file the chart gives the driver (deploy/ is the chart rendered
// with its defaults), so it works in the controller pod without flags.
func TestDiagnoseDefaultsToTheChartsKubeconfig(t *testing.T) {
	manifest, err := os.ReadFile(filepath.Join("..", "..", "deploy", "harvester-csi-driver.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`--kubeconfig=(\S+)`).FindSubmatch(manifest)
	if m == nil {
		t.Fatal("the rendered chart passes no --kubeconfig")
	}
	if env := podEnv(); env.HostKubeconfig != string(m[1]) {
		t.Errorf("diagnose's default host kubeconfig %s, the chart's %s", env.HostKubeconfig, m[1])
	}
}

func TestDiagnoseBadFlagsExit2(t *testing.T) {
	env := diagnose.Env{HostKubeconfig: "/nonexistent/a", HostFallback: "/nonexistent/b", InCluster: func() (*rest.Config, error) { return nil, rest.ErrNotInCluster }}
	for _, args := range [][]string{{"--no-such-flag"}, {"extra"}, {"-o", "yaml"}, {}} {
		var out, errOut bytes.Buffer
		if code := runDiagnose(context.Background(), args, env, &out, &errOut); code != diagnose.ExitCannotLook || errOut.Len() == 0 {
			t.Errorf("%v: exit %d, stderr %q", args, code, errOut.String())
		}
	}
}
