package bench

import (
	"flag"
	"fmt"
	"strings"
	"testing"

	"github.com/harvester-csi/harvester-csi-driver/internal/profile"
)

var harvesterFlag = flag.String("harvester", "", "Harvester release X.Y[.Z] (internal/profile): run the flavor it ships instead of -churn.flavor / -scale.flavor")

// flavorFlag is the flavor a churn or scale run selects by: the one
// -harvester's profile simulates, else flavorValue. A flavor flag given
// too (set) must select the same flavor, so a result never names one
// release and measures another.
func flavorFlag(release, name, flavorValue string, set bool) (string, error) {
	if release == "" {
		return flavorValue, nil
	}
	p, err := profile.Lookup(release)
	if err != nil {
		return "", fmt.Errorf("-harvester: %w", err)
	}
	want := p.SimKubeVirt()
	if set && !strings.Contains(want, flavorValue) {
		return "", fmt.Errorf("-%s %s and -harvester %s disagree: Harvester %s runs flavor %s", name, flavorValue, release, p.Releases, want)
	}
	return want, nil
}

// flagGiven says whether the named flag was on the command line.
func flagGiven(name string) bool {
	given := false
	flag.Visit(func(fl *flag.Flag) { given = given || fl.Name == name })
	return given
}

func TestFlavorFlag(t *testing.T) {
	for _, tc := range []struct {
		release, value string
		set            bool
		want, wantErr  string
	}{
		{"", "legacy", true, "legacy", ""},
		{"1.8.0", "", false, "declarative-v1.7.0", ""},
		{"1.6", "declarative-v1.7.0", false, "legacy-v1.5.3", ""},
		{"1.7.1", "legacy-v1.6.3", true, "legacy-v1.6.3", ""},
		{"1.7.2", "", false, "legacy-v1.6.6", ""},
		{"1.8.2", "declarative", true, "declarative-v1.7.4", ""},
		{"1.8.0", "legacy", true, "", "disagree"},
		{"1.5", "", false, "", "no profile"},
	} {
		got, err := flavorFlag(tc.release, "churn.flavor", tc.value, tc.set)
		if tc.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("-harvester %q, flavor %q (set %v): %q, %v; want an error with %q", tc.release, tc.value, tc.set, got, err, tc.wantErr)
			}
		} else if err != nil || got != tc.want {
			t.Errorf("-harvester %q, flavor %q (set %v): %q, %v; want %q", tc.release, tc.value, tc.set, got, err, tc.want)
		}
	}
}

// Every profile's simulated KubeVirt is a flavor the benchmarks run.
func TestEveryProfileIsAFlavor(t *testing.T) {
	for _, p := range profile.All() {
		found := false
		for _, f := range flavors {
			found = found || f.name == p.SimKubeVirt()
		}
		if !found {
			t.Errorf("Harvester %s: no flavor %s", p.Name, p.SimKubeVirt())
		}
	}
}
