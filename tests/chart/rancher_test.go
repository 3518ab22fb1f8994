package chart

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/yaml"

	"github.com/harvester-csi/harvester-csi-driver/tests/chart/render"
)

// rancherValues is what Rancher installs with: its system default registry and an answer to every question.
func rancherValues(t *testing.T) (string, map[string]interface{}) {
	t.Helper()
	file := filepath.Join(render.ChartDir(), "ci", "rancher-values.yaml")
	vals, err := render.ValuesFile(file)
	if err != nil {
		t.Fatal(err)
	}
	return file, vals
}

// TestRancherValuesAnswerEveryQuestion keeps ci/rancher-values.yaml what Rancher's form sends: a value for
// every question of questions.yaml.
func TestRancherValuesAnswerEveryQuestion(t *testing.T) {
	data, err := os.ReadFile(filepath.Join(render.ChartDir(), "questions.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var q struct {
		Questions []struct {
			Variable string `json:"variable"`
		} `json:"questions"`
	}
	if err := yaml.Unmarshal(data, &q); err != nil {
		t.Fatal(err)
	}
	_, vals := rancherValues(t)
	for _, qq := range q.Questions {
		if _, ok, _ := unstructured.NestedFieldNoCopy(vals, strings.Split(qq.Variable, ".")...); !ok {
			t.Errorf("ci/rancher-values.yaml does not answer the question %s", qq.Variable)
		}
	}
	if _, ok, _ := unstructured.NestedString(vals, "global", "cattle", "systemDefaultRegistry"); !ok {
		t.Error("ci/rancher-values.yaml does not set global.cattle.systemDefaultRegistry")
	}
}

// TestRancherInstall renders the chart as Rancher installs it and checks it object by object: which objects
// exist, every image reference (the system default registry in front of each repository that does not name a
// registry, never twice), the snapshot toggle taking the VolumeSnapshotClasses with it, and the form's detach
// guard and node monitor answers on the controller's driver.
func TestRancherInstall(t *testing.T) {
	_, vals := rancherValues(t)
	r := renderVals(t, vals)

	wantObjects := []string{
		"CSIDriver/driver.harvesterhci.io",
		"ClusterRole/harvester-csi-driver",
		"ClusterRole/harvester-csi-driver-node",
		"ClusterRoleBinding/harvester-csi-driver",
		"ClusterRoleBinding/harvester-csi-driver-node",
		"DaemonSet/harvester-csi-driver",
		"Deployment/harvester-csi-driver-controllers",
		"PodDisruptionBudget/harvester-csi-driver-controllers",
		"Role/harvester-csi-driver-leader-election",
		"RoleBinding/harvester-csi-driver-leader-election",
		"Service/harvester-csi-driver-controllers-metrics",
		"Service/harvester-csi-driver-node-metrics",
		"ServiceAccount/harvester-csi-driver",
		"ServiceAccount/harvester-csi-driver-node",
		"StorageClass/harvester",
	}
	// No VolumeSnapshotClass: with controller.snapshotter.enabled=false it would fail the install on a cluster
	// without the snapshot CRDs. No ServiceMonitor, PrometheusRule or dashboard ConfigMap: the form said no.
	if got := r.names(); !slices.Equal(got, wantObjects) {
		t.Errorf("Rancher's install renders\n  %s\nwant\n  %s", strings.Join(got, "\n  "), strings.Join(wantObjects, "\n  "))
	}

	const (
		mirror = "rancher-mirror.example.com:5000/"
		driver = "registry.example.com/storage/harvester-csi/harvester-csi-driver:v0.3.0-rc.1"
	)
	sidecar := func(key string) string {
		img := nested(t, r.eff, "image", "csi", key).(map[string]interface{})
		return mirror + sprint(img["repository"]) + ":" + sprint(img["tag"])
	}
	d := typed[appsv1.Deployment](t, r.must(t, "Deployment", controllerName))
	ds := typed[appsv1.DaemonSet](t, r.must(t, "DaemonSet", nodeName))
	for _, c := range []struct {
		pod        string
		spec       corev1.PodSpec
		containers map[string]string // container: image
	}{
		{"controller", d.Spec.Template.Spec, map[string]string{
			"harvester-csi-driver": driver,
			"csi-provisioner":      sidecar("provisioner"),
			"csi-attacher":         sidecar("attacher"),
			"csi-resizer":          sidecar("resizer"),
			"liveness-probe":       sidecar("livenessProbe"),
		}},
		{"node", ds.Spec.Template.Spec, map[string]string{
			"harvester-csi-driver":  driver,
			"node-driver-registrar": sidecar("nodeDriverRegistrar"),
			"liveness-probe":        sidecar("livenessProbe"),
		}},
	} {
		var names []string
		for _, ct := range c.spec.Containers {
			names = append(names, ct.Name)
			if want, ok := c.containers[ct.Name]; !ok {
				t.Errorf("%s pod: unexpected container %s (%s)", c.pod, ct.Name, ct.Image)
			} else if ct.Image != want {
				t.Errorf("%s pod: container %s image %q, want %q", c.pod, ct.Name, ct.Image, want)
			}
		}
		for _, ct := range c.spec.InitContainers {
			t.Errorf("%s pod: init container %s with the host kubeconfig in a Secret", c.pod, ct.Name)
		}
		if len(names) != len(c.containers) {
			t.Errorf("%s pod containers %v, want %d", c.pod, names, len(c.containers))
		}
		if len(c.spec.ImagePullSecrets) != 1 || c.spec.ImagePullSecrets[0].Name != "mirror-pull" {
			t.Errorf("%s pod imagePullSecrets %v, want mirror-pull", c.pod, c.spec.ImagePullSecrets)
		}
	}

	drv := container(t, d.Spec.Template.Spec.Containers, "harvester-csi-driver")
	for flag, want := range map[string]string{
		"detach-guard-timeout": "2m30s", "node-monitor": "false", "batch-window": "500ms", "max-hold": "45s",
		"hotplug-workers": "20", "hotplug-qps": "5", "hotplug-burst": "10", "host-storage-class": "longhorn-ssd",
		"debug": "",
	} {
		if v, ok := argValue(drv.Args, flag); !ok || v != want {
			t.Errorf("controller driver --%s=%q (present %v), the form answered %q", flag, v, ok, want)
		}
	}
	att := container(t, d.Spec.Template.Spec.Containers, "csi-attacher")
	for flag, want := range map[string]string{"worker-threads": "200", "timeout": "3m"} {
		if v, _ := argValue(att.Args, flag); v != want {
			t.Errorf("csi-attacher --%s=%q, the form answered %q", flag, v, want)
		}
	}
	if *d.Spec.Replicas != 2 {
		t.Errorf("controller replicas %d, the form answered 2", *d.Spec.Replicas)
	}
	if sc := r.must(t, "StorageClass", "harvester"); sc.GetAnnotations()["storageclass.kubernetes.io/is-default-class"] != "false" {
		t.Errorf("StorageClass harvester annotations %v: the form said not default", sc.GetAnnotations())
	}
	if v := volumesByName(ds.Spec.Template.Spec.Volumes)["cloud-config"]; v.Secret == nil || v.Secret.SecretName != "harvester-cloud-config" {
		t.Errorf("node cloud-config volume %+v, want the Secret harvester-cloud-config", v.VolumeSource)
	}
}

// TestDetachGuardAndNodeMonitorFlags: the controller's driver gets both from the values, with the binary's
// defaults (6m, on) when nothing is set.
func TestDetachGuardAndNodeMonitorFlags(t *testing.T) {
	for _, c := range []struct {
		name                           string
		vals                           map[string]interface{}
		guard, monitor, orphans, grace string
	}{
		{name: "defaults", vals: map[string]interface{}{}, guard: "6m", monitor: "true", orphans: "true", grace: "2m"},
		{name: "guard off, monitor off, orphan reconciler off", vals: map[string]interface{}{"controller": map[string]interface{}{
			"detachGuardTimeout": "0s", "nodeMonitor": false, "orphanReconciler": false, "orphanGrace": "10m"}},
			guard: "0s", monitor: "false", orphans: "false", grace: "10m"},
	} {
		t.Run(c.name, func(t *testing.T) {
			r := renderVals(t, c.vals)
			drv := container(t, typed[appsv1.Deployment](t, r.must(t, "Deployment", controllerName)).Spec.Template.Spec.Containers, "harvester-csi-driver")
			if v, _ := argValue(drv.Args, "detach-guard-timeout"); v != c.guard {
				t.Errorf("--detach-guard-timeout=%q, want %q", v, c.guard)
			}
			if v, _ := argValue(drv.Args, "node-monitor"); v != c.monitor {
				t.Errorf("--node-monitor=%q, want %q", v, c.monitor)
			}
			if v, _ := argValue(drv.Args, "orphan-reconciler"); v != c.orphans {
				t.Errorf("--orphan-reconciler=%q, want %q", v, c.orphans)
			}
			if v, _ := argValue(drv.Args, "orphan-grace"); v != c.grace {
				t.Errorf("--orphan-grace=%q, want %q", v, c.grace)
			}
		})
	}
}

// TestPublishWaitCrowdIsHalfTheAttachersWorkers: the driver answers "in progress" only once half of the
// attacher's workers wait in it, so a chart with many workers keeps blocking publishes (answered as soon as
// KubeVirt is done) and one with few still frees them for the rest of a wave.
func TestPublishWaitCrowdIsHalfTheAttachersWorkers(t *testing.T) {
	for _, c := range []struct {
		workers interface{}
		crowd   string
	}{{nil, "50"}, {10, "5"}, {3, "1"}, {1, "1"}} {
		vals := map[string]interface{}{}
		if c.workers != nil {
			vals["controller"] = map[string]interface{}{"attacher": map[string]interface{}{"workerThreads": c.workers}}
		}
		r := renderVals(t, vals)
		drv := container(t, typed[appsv1.Deployment](t, r.must(t, "Deployment", controllerName)).Spec.Template.Spec.Containers, "harvester-csi-driver")
		if v, _ := argValue(drv.Args, "publish-wait-crowd"); v != c.crowd {
			t.Errorf("workerThreads %v: --publish-wait-crowd=%q, want %q", c.workers, v, c.crowd)
		}
	}
}

// TestImageRegistryPrefix: Rancher's system default registry goes in front of a repository that does not
// name a registry, and never in front of one that does (first path component with "." or ":" or
// "localhost"), which would give reg/reg/... that no runtime can pull.
func TestImageRegistryPrefix(t *testing.T) {
	const sdr = "mirror.example.com"
	for _, c := range []struct{ registry, repository, want string }{
		{"", "harvester-csi/harvester-csi-driver", "harvester-csi/harvester-csi-driver"},
		{sdr, "harvester-csi/harvester-csi-driver", sdr + "/harvester-csi/harvester-csi-driver"},
		{sdr + "/", "harvester-csi/harvester-csi-driver", sdr + "/harvester-csi/harvester-csi-driver"},
		{sdr, sdr + "/harvester-csi/harvester-csi-driver", sdr + "/harvester-csi/harvester-csi-driver"},
		{sdr, "registry.local:5000/harvester-csi/harvester-csi-driver", "registry.local:5000/harvester-csi/harvester-csi-driver"},
		{sdr, "mirror:5000/harvester-csi/harvester-csi-driver", "mirror:5000/harvester-csi/harvester-csi-driver"},
		{sdr, "localhost/harvester-csi/harvester-csi-driver", "localhost/harvester-csi/harvester-csi-driver"},
		{sdr, "my.org/harvester-csi/harvester-csi-driver", "my.org/harvester-csi/harvester-csi-driver"},
	} {
		t.Run(c.registry+" "+c.repository, func(t *testing.T) {
			vals := driverImageValues(c.repository, "v0.3.0", false)
			vals["global"] = map[string]interface{}{"cattle": map[string]interface{}{"systemDefaultRegistry": c.registry}}
			vals["image"].(map[string]interface{})["csi"] = map[string]interface{}{"attacher": map[string]interface{}{"repository": strings.Replace(c.repository, "harvester-csi/harvester-csi-driver", "sig-storage/csi-attacher", 1), "tag": "v4.12.0"}}
			images, err := render.Images(loadChart(t), vals)
			if err != nil {
				t.Fatal(err)
			}
			for _, want := range []string{c.want + ":v0.3.0", strings.Replace(c.want, "harvester-csi/harvester-csi-driver", "sig-storage/csi-attacher", 1) + ":v4.12.0"} {
				if !contains(images, want) {
					t.Errorf("images %v, want %s", images, want)
				}
			}
		})
	}
}

// TestShippedSidecarsAreTheTestedOnes: the attacher, resizer, provisioner and snapshotter the chart ships are
// the versions tools/ builds and the tests run. A rebuild suffix (-<date>, Longhorn's rebuild of the same
// source in Rancher's mirrors) is not a different version.
func TestShippedSidecarsAreTheTestedOnes(t *testing.T) {
	tested := map[string]struct{ dir, module string }{
		"attacher":    {"attacher", "github.com/kubernetes-csi/external-attacher"},
		"resizer":     {"resizer", "github.com/kubernetes-csi/external-resizer"},
		"provisioner": {"provisioner", "github.com/kubernetes-csi/external-provisioner"},
		"snapshotter": {"snapshotter", "github.com/kubernetes-csi/external-snapshotter"},
	}
	// Sidecars the tests do not run: the lab registers the driver with its own registrar
	// (tools/kubelet/cmd/csi-registrar) and probes it without the livenessprobe.
	untested := []string{"nodeDriverRegistrar", "livenessProbe"}

	sidecars := nested(t, loadChart(t).Values, "image", "csi").(map[string]interface{})
	var keys []string
	for k := range sidecars {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	rebuild := regexp.MustCompile(`^(v[0-9]+\.[0-9]+\.[0-9]+)(-[0-9]{8})?$`)
	for _, k := range keys {
		tag := sprint(sidecars[k].(map[string]interface{})["tag"])
		m := rebuild.FindStringSubmatch(tag)
		if m == nil {
			t.Errorf("image.csi.%s.tag %q is not vX.Y.Z or vX.Y.Z-<date>", k, tag)
			continue
		}
		// Rancher's mirrors carry recent sidecars only under Longhorn's rebuild tags; a plain tag there is
		// very likely missing.
		if repo := sprint(sidecars[k].(map[string]interface{})["repository"]); strings.HasPrefix(repo, "rancher/mirrored-longhornio-") && m[2] == "" {
			t.Errorf("image.csi.%s %s:%s: Rancher's mirror carries recent sidecars only as <version>-<date> rebuilds", k, repo, tag)
		}
		tool, ok := tested[k]
		if !ok {
			if !slices.Contains(untested, k) {
				t.Errorf("image.csi.%s: no tools/ module builds it for the tests; add one or list it as untested here", k)
			}
			continue
		}
		got, err := toolVersion(filepath.Join(render.RepoRoot(), "tools", tool.dir, "go.mod"), tool.module)
		if err != nil {
			t.Error(err)
			continue
		}
		if got != m[1] {
			t.Errorf("the chart ships %s %s (image.csi.%s.tag %q) but tools/%s builds %s for the tests: pin one version in both",
				tool.module, m[1], k, tag, tool.dir, got)
		}
	}
}

// toolVersion is the version a tools module's go.mod requires of module (any major version suffix).
func toolVersion(goMod, module string) (string, error) {
	data, err := os.ReadFile(goMod)
	if err != nil {
		return "", err
	}
	re := regexp.MustCompile(`(?m)^\s*(?:require\s+)?` + regexp.QuoteMeta(module) + `(?:/v[0-9]+)?\s+(v\S+)`)
	m := re.FindSubmatch(data)
	if m == nil {
		return "", &os.PathError{Op: "find " + module + " in", Path: goMod, Err: os.ErrNotExist}
	}
	return string(m[1]), nil
}

// TestDeployNamesTheDriverImage: deploy/ says which image it runs and where to set another, since the
// driver's image is not published.
func TestDeployNamesTheDriverImage(t *testing.T) {
	data, err := os.ReadFile(render.DeployFile())
	if err != nil {
		t.Fatal(err)
	}
	header, _, _ := strings.Cut(string(data), "\n---")
	image := "harvester-csi/harvester-csi-driver:" + loadChart(t).Metadata.AppVersion
	lines := strings.Count(string(data), "image: "+image+"\n")
	if lines == 0 {
		t.Fatalf("deploy/ does not run %s", image)
	}
	for _, want := range []string{"The driver image is " + image, "on its " + strconv.Itoa(lines) + ` "image:" lines`, "make release", "--set image.harvester.csiDriver.repository="} {
		if !strings.Contains(header, want) {
			t.Errorf("deploy/ header does not say %q:\n%s", want, header)
		}
	}
}
