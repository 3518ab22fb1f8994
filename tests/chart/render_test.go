package chart

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/Masterminds/semver/v3"
	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/yaml"

	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"

	"github.com/harvester-csi/harvester-csi-driver/tests/chart/render"
)

const (
	controllerName = "harvester-csi-driver-controllers"
	nodeName       = "harvester-csi-driver"
	controllerSA   = "harvester-csi-driver"
	nodeSA         = "harvester-csi-driver-node"
	driverName     = "driver.harvesterhci.io"
	cloudConfig    = "/var/lib/harvester/cloud-provider-config"
	// hotplugCycle is how long KubeVirt takes to apply one hotplug change to a VM
	// (it recreates the VM's attachment pod): 8-10 s.
	hotplugCycle = 10 * time.Second
)

var controllerSidecars = []string{"csi-provisioner", "csi-attacher", "csi-resizer"}

// optionalSidecars run only when their values enable them.
var optionalSidecars = []string{"csi-snapshotter"}

func TestLint(t *testing.T) {
	for _, vs := range valueSets(t) {
		t.Run(vs.name, func(t *testing.T) {
			vals, err := render.ValuesFile(vs.file)
			if err != nil {
				t.Fatal(err)
			}
			msgs, err := render.Lint(render.ChartDir(), vals)
			if err != nil {
				t.Fatal(err)
			}
			for _, m := range msgs {
				t.Log(m)
			}
		})
	}
}

func TestEveryObjectMatchesItsAPIType(t *testing.T) {
	for _, vs := range valueSets(t) {
		t.Run(vs.name, func(t *testing.T) {
			r := renderSet(t, vs)
			if len(r.objects) == 0 {
				t.Fatal("nothing rendered")
			}
			for _, o := range r.objects {
				gvk := o.GroupVersionKind()
				var target interface{}
				switch gvk {
				case snapshotv1.SchemeGroupVersion.WithKind("VolumeSnapshotClass"):
					target = &snapshotv1.VolumeSnapshotClass{}
				case monitoringv1.SchemeGroupVersion.WithKind("ServiceMonitor"):
					target = &monitoringv1.ServiceMonitor{}
				case monitoringv1.SchemeGroupVersion.WithKind("PrometheusRule"):
					target = &monitoringv1.PrometheusRule{}
				default:
					obj, err := scheme.Scheme.New(gvk)
					if err != nil {
						t.Errorf("%s %s: not a built-in API type: %v", gvk, o.GetName(), err)
						continue
					}
					target = obj
				}
				if err := fromUnstructuredStrict(o, target); err != nil {
					t.Errorf("%s %s: %v", gvk.Kind, o.GetName(), err)
				}
			}
		})
	}
}

func TestCatalogAnnotations(t *testing.T) {
	ch := loadChart(t)
	a := ch.Metadata.Annotations
	want := map[string]string{
		"catalog.cattle.io/namespace":    render.Namespace,
		"catalog.cattle.io/release-name": render.ReleaseName,
		"catalog.cattle.io/os":           "linux",
		"catalog.cattle.io/ui-component": "harvester-csi-driver",
		"catalog.cattle.io/display-name": "Harvester CSI Driver",
	}
	for k, v := range want {
		if a[k] != v {
			t.Errorf("Chart.yaml annotation %s = %q, want %q", k, a[k], v)
		}
	}
	for _, k := range []string{"catalog.cattle.io/kube-version", "catalog.cattle.io/rancher-version"} {
		if _, err := semver.NewConstraint(a[k]); err != nil || a[k] == "" {
			t.Errorf("Chart.yaml annotation %s = %q is not a version range: %v", k, a[k], err)
		}
	}
	if _, err := semver.NewVersion(a["catalog.cattle.io/upstream-version"]); err != nil {
		t.Errorf("catalog.cattle.io/upstream-version %q: %v", a["catalog.cattle.io/upstream-version"], err)
	}
	kv, _ := semver.NewConstraint(a["catalog.cattle.io/kube-version"])
	for _, v := range []string{"1.28.0", "1.33.5", "1.35.4"} {
		if kv != nil && !kv.Check(semver.MustParse(v)) {
			t.Errorf("catalog.cattle.io/kube-version %q excludes Kubernetes %s", a["catalog.cattle.io/kube-version"], v)
		}
	}
	// "rancher" is the badge of Rancher's own charts, "partner" that of its partner program: neither is this chart's.
	if v, ok := a["catalog.cattle.io/certified"]; ok {
		t.Errorf("Chart.yaml annotation catalog.cattle.io/certified = %q claims a certification this chart does not have", v)
	}
	checkIcon(t, ch.Metadata.Icon)
	if ch.Metadata.Name != "harvester-csi-driver" {
		t.Errorf("chart name %q: Rancher and `helm upgrade` from upstream need harvester-csi-driver", ch.Metadata.Name)
	}
	if ch.Metadata.KubeVersion != "" {
		t.Errorf("Chart.yaml kubeVersion %q: Rancher cannot edit an installed app whose kubeVersion excludes the cluster; use the catalog annotation", ch.Metadata.KubeVersion)
	}
}

// TestQuestions checks Rancher's install form: each question's variable is a
// value of the chart, with the same default, and the form asks what a Rancher
// user must decide.
func TestQuestions(t *testing.T) {
	data, err := os.ReadFile(filepath.Join(render.ChartDir(), "questions.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var q struct {
		Categories []string `json:"categories"`
		Namespace  string   `json:"namespace"`
		Questions  []struct {
			Variable    string      `json:"variable"`
			Label       string      `json:"label"`
			Description string      `json:"description"`
			Type        string      `json:"type"`
			Default     interface{} `json:"default"`
			Group       string      `json:"group"`
			ShowIf      string      `json:"show_if"`
			Required    bool        `json:"required"`
			Min         *int        `json:"min"`
			Max         *int        `json:"max"`
		} `json:"questions"`
	}
	if err := yaml.UnmarshalStrict(data, &q); err != nil {
		t.Fatalf("questions.yaml: %v", err)
	}
	if q.Namespace != render.Namespace {
		t.Errorf("questions.yaml namespace %q, want %q", q.Namespace, render.Namespace)
	}
	vals := loadChart(t).Values
	seen := map[string]bool{}
	for _, qq := range q.Questions {
		seen[qq.Variable] = true
		if qq.Label == "" || qq.Group == "" {
			t.Errorf("question %s: label and group are required", qq.Variable)
		}
		v, ok, err := unstructured.NestedFieldNoCopy(vals, strings.Split(qq.Variable, ".")...)
		if err != nil || !ok {
			t.Errorf("question %s: no such value in values.yaml", qq.Variable)
			continue
		}
		var match bool
		switch qq.Type {
		case "string":
			s, isStr := v.(string)
			match = isStr && s == qq.Default
		case "int":
			match = sprint(v) == sprint(qq.Default)
			if _, err := strconv.Atoi(sprint(v)); err != nil {
				match = false
			}
		case "boolean":
			b, isBool := v.(bool)
			match = isBool && b == qq.Default
		default:
			t.Errorf("question %s: unexpected type %q", qq.Variable, qq.Type)
			continue
		}
		if !match {
			t.Errorf("question %s: default %#v differs from values.yaml %#v", qq.Variable, qq.Default, v)
		}
		if qq.ShowIf != "" {
			ref, _, _ := strings.Cut(qq.ShowIf, "=")
			if _, ok, _ := unstructured.NestedFieldNoCopy(vals, strings.Split(ref, ".")...); !ok {
				t.Errorf("question %s: show_if refers to unknown value %q", qq.Variable, ref)
			}
		}
	}
	for _, v := range []string{"cloudConfig.hostPath", "cloudConfig.secretName", "hostStorageClass",
		"hotplug.batchWindow", "hotplug.maxHold", "hotplug.workers", "hotplug.qps", "hotplug.burst"} {
		if !seen[v] {
			t.Errorf("questions.yaml does not ask for %s", v)
		}
	}
}

func TestControllerDeployment(t *testing.T) {
	for _, vs := range valueSets(t) {
		t.Run(vs.name, func(t *testing.T) {
			r := renderSet(t, vs)
			d := typed[appsv1.Deployment](t, r.must(t, "Deployment", controllerName))
			spec := d.Spec.Template.Spec
			wantSel := map[string]string{"component": "csi-controllers", "app.kubernetes.io/name": "harvester-csi-driver", "app.kubernetes.io/instance": render.ReleaseName}
			if !reflect.DeepEqual(d.Spec.Selector.MatchLabels, wantSel) || len(d.Spec.Selector.MatchExpressions) != 0 {
				t.Errorf("selector %v, want upstream's %v", d.Spec.Selector, wantSel)
			}
			if d.Namespace != render.Namespace {
				t.Errorf("namespace %q", d.Namespace)
			}
			if got, want := int(*d.Spec.Replicas), toInt(t, nested(t, r.eff, "replicasCount")); got != want {
				t.Errorf("replicas %d, want replicasCount %d", got, want)
			}
			if spec.ServiceAccountName != controllerSA {
				t.Errorf("serviceAccountName %q, want %q", spec.ServiceAccountName, controllerSA)
			}
			names := containerNames(spec.Containers)
			sidecars := controllerSidecars
			if nested(t, r.eff, "controller", "snapshotter", "enabled").(bool) {
				sidecars = append(sidecars, "csi-snapshotter")
			} else if slices.Contains(names, "csi-snapshotter") {
				t.Error("csi-snapshotter runs although controller.snapshotter.enabled is false")
			}
			for _, n := range append([]string{"harvester-csi-driver", "liveness-probe"}, sidecars...) {
				if !slices.Contains(names, n) {
					t.Errorf("controller pod lacks container %s (has %v)", n, names)
				}
			}

			// The driver runs in the pod, on a socket in an emptyDir: no shared hostPath socket.
			vols := volumesByName(spec.Volumes)
			if v := vols["socket-dir"]; v.EmptyDir == nil {
				t.Errorf("socket-dir is not an emptyDir: %+v", v.VolumeSource)
			}
			for _, c := range spec.Containers {
				for _, m := range c.VolumeMounts {
					if vols[m.Name].HostPath != nil {
						t.Errorf("controller container %s mounts hostPath volume %s", c.Name, m.Name)
					}
				}
			}
			drv := container(t, spec.Containers, "harvester-csi-driver")
			if v, _ := argValue(drv.Args, "mode"); v != "controller" {
				t.Errorf("controller driver --mode=%q", v)
			}
			checkDriverCommon(t, r, drv)
			checkCloudConfig(t, r, spec, drv)
			for flag, key := range map[string]string{
				"hotplug-backend": "hotplug.backend", "batch-window": "hotplug.batchWindow", "max-hold": "hotplug.maxHold",
				"join-window":     "hotplug.joinWindow",
				"hotplug-workers": "hotplug.workers", "hotplug-qps": "hotplug.qps", "hotplug-burst": "hotplug.burst",
				"publish-margin": "hotplug.publishMargin", "wedged-after": "hotplug.wedgedAfter",
				"one-removal-at-a-time": "hotplug.oneRemovalAtATime",
			} {
				v, ok := argValue(drv.Args, flag)
				if want := sprint(nested(t, r.eff, strings.Split(key, ".")...)); !ok || v != want {
					t.Errorf("driver --%s=%q, want %s=%q", flag, v, key, want)
				}
			}

			// Sidecars: leader election everywhere, explicit QPS, a timeout, diagnostics with a liveness probe.
			for _, name := range sidecars {
				c := container(t, spec.Containers, name)
				for _, f := range []string{"leader-election", "leader-election-namespace", "timeout", "kube-api-qps", "kube-api-burst", "http-endpoint", "csi-address"} {
					if _, ok := argValue(c.Args, f); !ok {
						t.Errorf("%s lacks --%s", name, f)
					}
				}
				if c.LivenessProbe == nil || c.LivenessProbe.HTTPGet == nil || c.LivenessProbe.HTTPGet.Path != "/healthz/leader-election" {
					t.Errorf("%s: no liveness probe on /healthz/leader-election", name)
				} else if ep, _ := argValue(c.Args, "http-endpoint"); !portNamed(c, c.LivenessProbe.HTTPGet.Port.String(), ep) {
					t.Errorf("%s: liveness probe port %s is not the --http-endpoint %s", name, c.LivenessProbe.HTTPGet.Port.String(), ep)
				}
				if !mountsAt(c, "socket-dir", "/csi") {
					t.Errorf("%s does not mount the socket at /csi", name)
				}
			}
			checkAttacherSizing(t, r, container(t, spec.Containers, "csi-attacher"))
			checkLivenessProbe(t, spec.Containers, drv)

			// Least privilege: non-root pod; every container without privileges and with a read-only root.
			psc := spec.SecurityContext
			if psc == nil || psc.RunAsNonRoot == nil || !*psc.RunAsNonRoot || psc.RunAsUser == nil || *psc.RunAsUser == 0 {
				t.Errorf("controller pod securityContext is not non-root: %+v", psc)
			}
			for _, c := range append(slices.Clone(spec.Containers), spec.InitContainers...) {
				sc := c.SecurityContext
				if sc == nil || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem ||
					sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation ||
					(sc.Privileged != nil && *sc.Privileged) || sc.Capabilities == nil ||
					!slices.Contains(sc.Capabilities.Drop, "ALL") || len(sc.Capabilities.Add) != 0 {
					t.Errorf("controller container %s securityContext is not locked down: %+v", c.Name, sc)
				}
				if slices.Contains(containerNames(spec.Containers), c.Name) && sc != nil && sc.RunAsUser != nil && *sc.RunAsUser == 0 {
					t.Errorf("controller container %s runs as root", c.Name)
				}
			}
			checkResources(t, spec)
			checkImages(t, r, spec)
			if spec.PriorityClassName == "" {
				t.Error("controller pod has no priorityClassName")
			}
			if spec.Affinity == nil || spec.Affinity.NodeAffinity == nil {
				t.Error("controller pod lost upstream's control-plane node affinity")
			}
		})
	}
}

func TestNodeDaemonSet(t *testing.T) {
	for _, vs := range valueSets(t) {
		t.Run(vs.name, func(t *testing.T) {
			r := renderSet(t, vs)
			ds := typed[appsv1.DaemonSet](t, r.must(t, "DaemonSet", nodeName))
			spec := ds.Spec.Template.Spec
			wantSel := map[string]string{"component": "csi-driver", "app.kubernetes.io/name": "harvester-csi-driver", "app.kubernetes.io/instance": render.ReleaseName}
			if !reflect.DeepEqual(ds.Spec.Selector.MatchLabels, wantSel) || len(ds.Spec.Selector.MatchExpressions) != 0 {
				t.Errorf("selector %v, want upstream's %v", ds.Spec.Selector, wantSel)
			}
			if spec.ServiceAccountName != nodeSA {
				t.Errorf("serviceAccountName %q, want %q", spec.ServiceAccountName, nodeSA)
			}
			drv := container(t, spec.Containers, "harvester-csi-driver")
			if v, _ := argValue(drv.Args, "mode"); v != "node" {
				t.Errorf("node driver --mode=%q", v)
			}
			// The node ID is the VM name, which the driver discovers; --nodeid only when the user sets one.
			nodeID := sprint(nested(t, r.eff, "node", "nodeID"))
			if v, ok := argValue(drv.Args, "nodeid"); nodeID == "" && ok {
				t.Errorf("--nodeid=%q passed although node.nodeID is empty", v)
			} else if nodeID != "" && v != nodeID {
				t.Errorf("--nodeid=%q, want node.nodeID %q", v, nodeID)
			}
			for _, e := range drv.Env {
				if e.Name == "NODE_ID" || strings.Contains(e.Value, "NODE_ID") {
					t.Errorf("upstream's NODE_ID (spec.nodeName as node ID) must not come back: %+v", e)
				}
			}
			checkDriverCommon(t, r, drv)
			checkCloudConfig(t, r, spec, drv)
			for flag, key := range map[string]string{"sysfs-root": "node.sysfsRoot", "by-id-dir": "node.byIdDir", "sweep-interval": "node.sweepInterval"} {
				if v, _ := argValue(drv.Args, flag); v != sprint(nested(t, r.eff, strings.Split(key, ".")...)) {
					t.Errorf("--%s=%q, want %s", flag, v, key)
				}
			}

			kubelet := strings.TrimSuffix(sprint(nested(t, r.eff, "kubeletRootDir")), "/")
			// The stale staging sweeper touches nothing outside this root.
			if v, _ := argValue(drv.Args, "kubelet-root-dir"); v != kubelet {
				t.Errorf("--kubelet-root-dir=%q, want kubeletRootDir %s", v, kubelet)
			}
			vols := volumesByName(spec.Volumes)
			socketDir := kubelet + "/harvester-plugins/driver.harvesterhci.io"
			if v := vols["socket-dir"]; v.HostPath == nil || v.HostPath.Path != socketDir {
				t.Errorf("node socket-dir %+v, want hostPath %s", v.VolumeSource, socketDir)
			}
			reg := container(t, spec.Containers, "node-driver-registrar")
			if v, _ := argValue(reg.Args, "kubelet-registration-path"); v != socketDir+"/csi.sock" {
				t.Errorf("registrar --kubelet-registration-path=%q, want %s/csi.sock", v, socketDir)
			}
			if v := vols["registration-dir"]; v.HostPath == nil || v.HostPath.Path != kubelet+"/plugins_registry" {
				t.Errorf("registration-dir %+v", v.VolumeSource)
			}
			for _, m := range []struct{ vol, path string }{{"kubelet-pods", kubelet + "/pods"}, {"kubelet-csi", kubelet + "/plugins/kubernetes.io/csi"}} {
				if v := vols[m.vol]; v.HostPath == nil || v.HostPath.Path != m.path {
					t.Errorf("%s: %+v, want hostPath %s", m.vol, v.VolumeSource, m.path)
				}
				found := false
				for _, vm := range drv.VolumeMounts {
					if vm.Name == m.vol && vm.MountPath == m.path && vm.MountPropagation != nil && *vm.MountPropagation == corev1.MountPropagationBidirectional {
						found = true
					}
				}
				if !found {
					t.Errorf("driver does not mount %s at %s with Bidirectional propagation", m.vol, m.path)
				}
			}
			// Privileged only where mounts need it: the driver container.
			for _, c := range spec.Containers {
				priv := c.SecurityContext != nil && c.SecurityContext.Privileged != nil && *c.SecurityContext.Privileged
				if priv != (c.Name == "harvester-csi-driver") {
					t.Errorf("node container %s privileged=%v", c.Name, priv)
				}
				if !priv && (c.SecurityContext == nil || c.SecurityContext.Capabilities == nil || !slices.Contains(c.SecurityContext.Capabilities.Drop, "ALL")) {
					t.Errorf("node container %s keeps capabilities", c.Name)
				}
			}
			if reg.LivenessProbe == nil {
				t.Error("registrar has no liveness probe")
			}
			checkLivenessProbe(t, spec.Containers, drv)
			checkResources(t, spec)
			checkImages(t, r, spec)
			if spec.PriorityClassName != "system-node-critical" {
				t.Errorf("node priorityClassName %q", spec.PriorityClassName)
			}
			if !reflect.DeepEqual(spec.Tolerations, typedTolerations(t, nested(t, r.eff, "tolerations"))) {
				t.Errorf("tolerations %v are not the values' tolerations", spec.Tolerations)
			}
		})
	}
}

// TestDriverFlagsAreKnown: every flag the chart passes to the driver is one the
// binary takes (an unknown flag is fatal at start-up). The list comes from
// docs/architecture.md; when cmd/harvester-csi-driver exists, from the binary's
// own help too.
func TestDriverFlagsAreKnown(t *testing.T) {
	doc, err := os.ReadFile(filepath.Join(render.RepoRoot(), "docs", "architecture.md"))
	if err != nil {
		t.Fatal(err)
	}
	_, cmdline, ok := strings.Cut(string(doc), "## Command line")
	if !ok {
		t.Fatal(`docs/architecture.md has no "## Command line" section`)
	}
	known := map[string]bool{}
	for _, m := range regexp.MustCompile("`--([a-z][a-z0-9-]*)").FindAllStringSubmatch(cmdline, -1) {
		known[m[1]] = true
	}
	if len(known) < 15 {
		t.Fatalf("found only %d flags in docs/architecture.md: %v", len(known), known)
	}
	help := driverHelp(t)
	for _, vs := range valueSets(t) {
		r := renderSet(t, vs)
		d := typed[appsv1.Deployment](t, r.must(t, "Deployment", controllerName))
		ds := typed[appsv1.DaemonSet](t, r.must(t, "DaemonSet", nodeName))
		for _, c := range []corev1.Container{container(t, d.Spec.Template.Spec.Containers, "harvester-csi-driver"), container(t, ds.Spec.Template.Spec.Containers, "harvester-csi-driver")} {
			for _, f := range flagNames(c.Args) {
				if !known[f] {
					t.Errorf("%s: driver flag --%s is not in docs/architecture.md", vs.name, f)
				}
				if !regexp.MustCompile(`(^|[\s,])--?` + regexp.QuoteMeta(f) + `\b`).MatchString(help) {
					t.Errorf("%s: the chart passes --%s, which cmd/harvester-csi-driver does not define (not in its --help): the pod would exit at start-up", vs.name, f)
				}
			}
		}
	}
}

// driverHelp builds cmd/harvester-csi-driver and returns its --help output;
// a command that is gone fails the build and with it the test, so the flags
// are never checked against the docs alone.
func driverHelp(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "harvester-csi-driver")
	build := exec.Command("go", "build", "-o", bin, "./cmd/harvester-csi-driver")
	build.Dir = render.RepoRoot()
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build the driver: %v\n%s", err, out)
	}
	var out bytes.Buffer
	cmd := exec.Command(bin, "--help")
	cmd.Stdout, cmd.Stderr = &out, &out
	_ = cmd.Run() // --help may exit non-zero
	if !strings.Contains(out.String(), "endpoint") {
		t.Fatalf("unexpected --help output:\n%s", out.String())
	}
	return out.String()
}

func TestStorageObjects(t *testing.T) {
	for _, vs := range valueSets(t) {
		t.Run(vs.name, func(t *testing.T) {
			r := renderSet(t, vs)
			cd := r.must(t, "CSIDriver", driverName)
			wantSpec := map[string]interface{}{"attachRequired": true, "podInfoOnMount": true, "fsGroupPolicy": "ReadWriteOnceWithFSType", "volumeLifecycleModes": []interface{}{"Persistent"}}
			if spec := cd.Object["spec"]; !reflect.DeepEqual(spec, wantSpec) {
				t.Errorf("CSIDriver spec %v, want %v", spec, wantSpec)
			}

			sc := r.find("StorageClass", "harvester")
			if create := nested(t, r.eff, "storageClass", "create").(bool); create != (sc != nil) {
				t.Fatalf("storageClass.create=%v but StorageClass rendered=%v", create, sc != nil)
			}
			if sc != nil {
				if sc.Object["provisioner"] != driverName || sc.Object["allowVolumeExpansion"] != true {
					t.Errorf("StorageClass harvester: %v", sc.Object)
				}
				wantDefault := sprint(nested(t, r.eff, "storageClass", "isDefault"))
				if got := sc.GetAnnotations()["storageclass.kubernetes.io/is-default-class"]; got != wantDefault {
					t.Errorf("StorageClass default annotation %q, want %q", got, wantDefault)
				}
				params, _, _ := unstructured.NestedStringMap(sc.Object, "parameters")
				wantParams := map[string]string{}
				for k, v := range nested(t, r.eff, "storageClass", "parameters").(map[string]interface{}) {
					wantParams[k] = sprint(v)
				}
				if len(params)+len(wantParams) > 0 && !reflect.DeepEqual(params, wantParams) {
					t.Errorf("StorageClass parameters %v, want %v", params, wantParams)
				}
			}

			// The snapshot classes go with the snapshotter: without it (and usually without the snapshot CRDs) they
			// would fail the install.
			snapshots := nested(t, r.eff, "controller", "snapshotter", "enabled").(bool)
			vsc := r.find("VolumeSnapshotClass", "harvester-snapshot")
			if create := snapshots && nested(t, r.eff, "volumeSnapshotClass", "create").(bool); create != (vsc != nil) {
				t.Fatalf("volumeSnapshotClass.create and snapshotter.enabled: %v, but VolumeSnapshotClass rendered=%v", create, vsc != nil)
			}
			if vsc != nil && (vsc.Object["driver"] != driverName || vsc.Object["deletionPolicy"] == nil) {
				t.Errorf("VolumeSnapshotClass harvester-snapshot: %v", vsc.Object)
			}
			backupName := sprint(nested(t, r.eff, "volumeSnapshotClass", "backup", "name"))
			backup := r.find("VolumeSnapshotClass", backupName)
			if create := snapshots && nested(t, r.eff, "volumeSnapshotClass", "backup", "create").(bool); create != (backup != nil) {
				t.Fatalf("backup class create=%v but rendered=%v", create, backup != nil)
			}
			if backup != nil {
				if p, _, _ := unstructured.NestedStringMap(backup.Object, "parameters"); p["type"] != "backup" {
					t.Errorf("backup VolumeSnapshotClass parameters %v, want type: backup", p)
				}
			}
		})
	}
}

func TestMetricsAndServiceMonitor(t *testing.T) {
	for _, vs := range valueSets(t) {
		t.Run(vs.name, func(t *testing.T) {
			r := renderSet(t, vs)
			enabled := nested(t, r.eff, "metrics", "enabled").(bool)
			smEnabled := nested(t, r.eff, "metrics", "serviceMonitor", "enabled").(bool)
			services := r.ofKind("Service")
			if enabled != (len(services) == 2) {
				t.Fatalf("metrics.enabled=%v but %d Services rendered", enabled, len(services))
			}
			sms := r.ofKind("ServiceMonitor")
			if (enabled && smEnabled) != (len(sms) == 1) {
				t.Fatalf("ServiceMonitor rendered %d times with metrics.enabled=%v serviceMonitor.enabled=%v", len(sms), enabled, smEnabled)
			}
			pods := map[string]corev1.PodSpec{
				"csi-controllers": typed[appsv1.Deployment](t, r.must(t, "Deployment", controllerName)).Spec.Template.Spec,
				"csi-driver":      typed[appsv1.DaemonSet](t, r.must(t, "DaemonSet", nodeName)).Spec.Template.Spec,
			}
			port := toInt(t, nested(t, r.eff, "metrics", "port"))
			for _, ps := range pods {
				for _, c := range ps.Containers {
					if c.Name != "harvester-csi-driver" {
						continue
					}
					addr, ok := argValue(c.Args, "metrics-address")
					if enabled != ok || (ok && addr != ":"+strconv.Itoa(port)) {
						t.Errorf("driver --metrics-address=%q (present %v), metrics.enabled=%v port %d", addr, ok, enabled, port)
					}
				}
			}
			for _, o := range services {
				svc := typed[corev1.Service](t, o)
				ps, ok := pods[svc.Spec.Selector["component"]]
				if !ok {
					t.Errorf("Service %s selects no workload: %v", svc.Name, svc.Spec.Selector)
					continue
				}
				for _, p := range svc.Spec.Ports {
					if !podHasPort(ps, p.TargetPort.String()) {
						t.Errorf("Service %s port %s targets %s, which no container declares", svc.Name, p.Name, p.TargetPort.String())
					}
				}
			}
			for _, o := range sms {
				sm := typed[monitoringv1.ServiceMonitor](t, o)
				if want := sprint(nested(t, r.eff, "metrics", "serviceMonitor", "namespace")); want != "" && sm.Namespace != want {
					t.Errorf("ServiceMonitor namespace %q, want %q", sm.Namespace, want)
				}
				for k, v := range nested(t, r.eff, "metrics", "serviceMonitor", "labels").(map[string]interface{}) {
					if sm.Labels[k] != sprint(v) {
						t.Errorf("ServiceMonitor lacks label %s=%v", k, v)
					}
				}
				for _, ep := range sm.Spec.Endpoints {
					found := false
					for _, o := range services {
						svc := typed[corev1.Service](t, o)
						if !labelsMatch(sm.Spec.Selector.MatchLabels, svc.Labels) {
							continue
						}
						for _, p := range svc.Spec.Ports {
							found = found || p.Name == ep.Port
						}
					}
					if !found {
						t.Errorf("ServiceMonitor endpoint port %q is on no selected Service", ep.Port)
					}
				}
			}
		})
	}
}

func TestPodDisruptionBudget(t *testing.T) {
	for _, vs := range valueSets(t) {
		t.Run(vs.name, func(t *testing.T) {
			r := renderSet(t, vs)
			pdbs := r.ofKind("PodDisruptionBudget")
			want := nested(t, r.eff, "controller", "podDisruptionBudget", "enabled").(bool) && toInt(t, nested(t, r.eff, "replicasCount")) > 1
			if want != (len(pdbs) == 1) {
				t.Fatalf("%d PodDisruptionBudgets rendered, want %v", len(pdbs), want)
			}
			if len(pdbs) == 1 {
				d := typed[appsv1.Deployment](t, r.must(t, "Deployment", controllerName))
				sel, _, _ := unstructured.NestedStringMap(pdbs[0].Object, "spec", "selector", "matchLabels")
				if !reflect.DeepEqual(sel, d.Spec.Selector.MatchLabels) {
					t.Errorf("PDB selector %v, Deployment selector %v", sel, d.Spec.Selector.MatchLabels)
				}
			}
		})
	}
}

func TestDeployManifestsUpToDate(t *testing.T) {
	want, err := render.DeployManifests()
	if err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(render.DeployFile())
	if err != nil {
		t.Fatalf("%v (run `make manifests`)", err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("%s is stale: run `make manifests` and commit the result", render.DeployFile())
	}
}

// TestDockerfile checks what can be checked without a Docker engine.
func TestDockerfile(t *testing.T) {
	data, err := os.ReadFile(filepath.Join(render.RepoRoot(), "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	df := string(data)
	froms := regexp.MustCompile(`(?m)^FROM\s+(?:--platform=\S+\s+)?(\S+)`).FindAllStringSubmatch(df, -1)
	if len(froms) < 2 {
		t.Fatalf("want a multi-stage build, found %d FROM lines", len(froms))
	}
	for _, f := range froms {
		ref := f[1]
		if !regexp.MustCompile(`^[a-z0-9./-]+:[A-Za-z0-9._-]+@sha256:[0-9a-f]{64}$`).MatchString(ref) || strings.Contains(ref, ":latest") {
			t.Errorf("base image %q is not pinned by tag and digest", ref)
		}
	}
	for _, want := range []string{"CGO_ENABLED=0", "-X main.version=", "-X main.commit=", "e2fsprogs", "xfsprogs", "util-linux", "nfs-common", "./cmd/harvester-csi-driver"} {
		if !strings.Contains(df, want) {
			t.Errorf("Dockerfile lacks %q", want)
		}
	}
	ignore, err := os.ReadFile(filepath.Join(render.RepoRoot(), ".dockerignore"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"!go.mod", "!go.sum", "!cmd", "!pkg", "!internal"} {
		if !strings.Contains(string(ignore), want) {
			t.Errorf(".dockerignore does not let %q into the build context", strings.TrimPrefix(want, "!"))
		}
	}
}

// --- helpers for the workload checks ---

func checkDriverCommon(t *testing.T, r *rendered, drv corev1.Container) {
	t.Helper()
	if v, _ := argValue(drv.Args, "endpoint"); v != "unix:///csi/csi.sock" || !mountsAt(drv, "socket-dir", "/csi") {
		t.Errorf("driver endpoint %q / socket mount", v)
	}
	if v, _ := argValue(drv.Args, "kubeconfig"); v != cloudConfig {
		t.Errorf("driver --kubeconfig=%q, want %s", v, cloudConfig)
	}
	hsc := sprint(nested(t, r.eff, "hostStorageClass"))
	if v, ok := argValue(drv.Args, "host-storage-class"); ok != (hsc != "") || v != hsc {
		t.Errorf("driver --host-storage-class=%q (present %v), hostStorageClass %q", v, ok, hsc)
	}
	if _, ok := argValue(drv.Args, "debug"); ok != nested(t, r.eff, "debug").(bool) {
		t.Errorf("driver --debug present=%v, debug=%v", ok, nested(t, r.eff, "debug"))
	}
	for flag, key := range map[string]string{"kube-api-qps": "kubeAPI.qps", "kube-api-burst": "kubeAPI.burst"} {
		if v, _ := argValue(drv.Args, flag); v != sprint(nested(t, r.eff, strings.Split(key, ".")...)) {
			t.Errorf("driver --%s=%q, want %s", flag, v, key)
		}
	}
}

// checkCloudConfig: the driver reads the host kubeconfig at the upstream path,
// from the Secret when cloudConfig.secretName is set, else from the node's
// cloudConfig.hostPath.
func checkCloudConfig(t *testing.T, r *rendered, spec corev1.PodSpec, drv corev1.Container) {
	t.Helper()
	if !mountsAt(drv, "cloud-config", filepath.Dir(cloudConfig)) {
		t.Errorf("driver does not mount cloud-config at %s", filepath.Dir(cloudConfig))
	}
	vols := volumesByName(spec.Volumes)
	secret := sprint(nested(t, r.eff, "cloudConfig", "secretName"))
	hostPath := sprint(nested(t, r.eff, "cloudConfig", "hostPath"))
	cc := vols["cloud-config"]
	if secret != "" {
		if cc.Secret == nil || cc.Secret.SecretName != secret {
			t.Errorf("cloud-config volume %+v, want Secret %s", cc.VolumeSource, secret)
		}
		if len(spec.InitContainers) != 0 {
			t.Errorf("init containers with a Secret kubeconfig: %v", containerNames(spec.InitContainers))
		}
		return
	}
	if cc.HostPath != nil {
		if cc.HostPath.Path != hostPath {
			t.Errorf("cloud-config hostPath %q, want cloudConfig.hostPath %q", cc.HostPath.Path, hostPath)
		}
		return
	}
	// Controller: an init container copies the root-only file for the non-root driver.
	if hp := vols["host-cloud-config"].HostPath; hp == nil || hp.Path != hostPath {
		t.Errorf("host-cloud-config %+v, want hostPath %q", vols["host-cloud-config"].VolumeSource, hostPath)
	}
	if cc.EmptyDir == nil || len(spec.InitContainers) != 1 || !mountsAt(spec.InitContainers[0], "cloud-config", filepath.Dir(cloudConfig)) {
		t.Errorf("controller without Secret: want an emptyDir filled by one init container; volume %+v, init %v", cc.VolumeSource, containerNames(spec.InitContainers))
	}
}

// checkAttacherSizing: the attacher must feed the batcher and wait for it.
func checkAttacherSizing(t *testing.T, r *rendered, c corev1.Container) {
	t.Helper()
	workers, _ := argValue(c.Args, "worker-threads")
	if n, err := strconv.Atoi(workers); err != nil || n < 100 {
		t.Errorf("csi-attacher --worker-threads=%q: want >= 100 so the per-VM queue sees concurrent requests", workers)
	}
	dur := func(key ...string) time.Duration {
		d, err := time.ParseDuration(sprint(nested(t, r.eff, key...)))
		if err != nil {
			t.Fatalf("%s: %v", strings.Join(key, "."), err)
		}
		return d
	}
	timeoutArg, _ := argValue(c.Args, "timeout")
	timeout, err := time.ParseDuration(timeoutArg)
	if err != nil {
		t.Fatalf("csi-attacher --timeout=%q: %v", timeoutArg, err)
	}
	need := dur("hotplug", "batchWindow") + dur("hotplug", "maxHold") + hotplugCycle + dur("hotplug", "publishMargin")
	if timeout <= need {
		t.Errorf("csi-attacher --timeout=%s must exceed batchWindow + maxHold + one hotplug cycle + publishMargin = %s", timeout, need)
	}
	if v, _ := argValue(c.Args, "worker-threads"); v != sprint(nested(t, r.eff, "controller", "attacher", "workerThreads")) {
		t.Errorf("csi-attacher --worker-threads=%s is not controller.attacher.workerThreads", v)
	}
}

// checkLivenessProbe: a livenessprobe sidecar on the driver's socket, and the
// driver container probed through it.
func checkLivenessProbe(t *testing.T, cs []corev1.Container, drv corev1.Container) {
	t.Helper()
	lp := container(t, cs, "liveness-probe")
	if !mountsAt(lp, "socket-dir", "/csi") {
		t.Error("liveness-probe does not see the driver socket")
	}
	port, _ := argValue(lp.Args, "health-port")
	if drv.LivenessProbe == nil || drv.LivenessProbe.HTTPGet == nil || drv.LivenessProbe.HTTPGet.Path != "/healthz" {
		t.Fatalf("driver container has no /healthz liveness probe")
	}
	if !portNamed(drv, drv.LivenessProbe.HTTPGet.Port.String(), ":"+port) {
		t.Errorf("driver liveness probe port %s is not the livenessprobe's --health-port %s", drv.LivenessProbe.HTTPGet.Port.String(), port)
	}
}

func checkResources(t *testing.T, spec corev1.PodSpec) {
	t.Helper()
	for _, c := range append(slices.Clone(spec.Containers), spec.InitContainers...) {
		if c.Resources.Requests.Cpu().IsZero() || c.Resources.Requests.Memory().IsZero() {
			t.Errorf("container %s has no CPU and memory requests", c.Name)
		}
	}
}

func checkImages(t *testing.T, r *rendered, spec corev1.PodSpec) {
	t.Helper()
	policy := corev1.PullPolicy(sprint(nested(t, r.eff, "image", "pullPolicy")))
	sidecars := map[string]string{
		"csi-provisioner": "provisioner", "csi-attacher": "attacher", "csi-resizer": "resizer", "csi-snapshotter": "snapshotter",
		"liveness-probe": "livenessProbe", "node-driver-registrar": "nodeDriverRegistrar",
	}
	for _, c := range append(slices.Clone(spec.Containers), spec.InitContainers...) {
		if c.ImagePullPolicy != policy {
			t.Errorf("container %s pull policy %q, want %q", c.Name, c.ImagePullPolicy, policy)
		}
		var img map[string]interface{}
		if c.Name == "harvester-csi-driver" || c.Name == "cloud-config" {
			img = nested(t, r.eff, "image", "harvester", "csiDriver").(map[string]interface{})
		} else if key, ok := sidecars[c.Name]; ok {
			img = nested(t, r.eff, "image", "csi", key).(map[string]interface{})
		} else {
			t.Errorf("container %s: no image value for it", c.Name)
			continue
		}
		tag := sprint(img["tag"])
		if tag == "" {
			tag = loadChart(t).Metadata.AppVersion
		}
		if want := withRegistry(sprint(nested(t, r.eff, "global", "cattle", "systemDefaultRegistry")), sprint(img["repository"])) + ":" + tag; c.Image != want {
			t.Errorf("container %s image %q, want %q", c.Name, c.Image, want)
		}
	}
	var want []string
	for _, s := range nested(t, r.eff, "global", "cattle", "imagePullSecrets").([]interface{}) {
		n := sprint(s)
		if m, ok := s.(map[string]interface{}); ok {
			n = sprint(m["name"])
		}
		if !slices.Contains(want, n) {
			want = append(want, n)
		}
	}
	var got []string
	for _, s := range spec.ImagePullSecrets {
		got = append(got, s.Name)
	}
	if !slices.Equal(got, want) {
		t.Errorf("imagePullSecrets %v, want %v", got, want)
	}
}

// withRegistry puts Rancher's system default registry in front of a repository that names no registry host
// (a first path component with "." or ":", or "localhost"), as container runtimes read references.
func withRegistry(registry, repository string) string {
	first, _, hasPath := strings.Cut(repository, "/")
	if registry == "" || (hasPath && (strings.ContainsAny(first, ".:") || first == "localhost")) {
		return repository
	}
	return strings.TrimSuffix(registry, "/") + "/" + repository
}

// checkIcon: an icon Rancher can show without internet access, a file:// path to an SVG in this repository.
func checkIcon(t *testing.T, icon string) {
	t.Helper()
	rel, ok := strings.CutPrefix(icon, "file://")
	if !ok || !strings.HasSuffix(rel, ".svg") {
		t.Fatalf("Chart.yaml icon %q: want file://<path of an SVG in this repository>", icon)
	}
	data, err := os.ReadFile(filepath.Join(render.RepoRoot(), filepath.FromSlash(rel)))
	if err != nil {
		t.Fatalf("Chart.yaml icon: %v", err)
	}
	if !regexp.MustCompile(`(?s)^\s*<svg\s[^>]*xmlns="http://www.w3.org/2000/svg".*</svg>\s*$`).Match(data) {
		t.Errorf("%s is not an SVG document", rel)
	}
}

func container(t *testing.T, cs []corev1.Container, name string) corev1.Container {
	t.Helper()
	for _, c := range cs {
		if c.Name == name {
			return c
		}
	}
	t.Fatalf("no container %s in %v", name, containerNames(cs))
	return corev1.Container{}
}

func containerNames(cs []corev1.Container) []string {
	var out []string
	for _, c := range cs {
		out = append(out, c.Name)
	}
	return out
}

func volumesByName(vs []corev1.Volume) map[string]corev1.Volume {
	m := map[string]corev1.Volume{}
	for _, v := range vs {
		m[v.Name] = v
	}
	return m
}

func mountsAt(c corev1.Container, vol, path string) bool {
	for _, m := range c.VolumeMounts {
		if m.Name == vol && strings.TrimSuffix(m.MountPath, "/") == path {
			return true
		}
	}
	return false
}

// portNamed: the container declares port `name` with the port of endpoint ":N".
func portNamed(c corev1.Container, name, endpoint string) bool {
	for _, p := range c.Ports {
		if p.Name == name && ":"+strconv.Itoa(int(p.ContainerPort)) == endpoint {
			return true
		}
	}
	return false
}

func podHasPort(ps corev1.PodSpec, name string) bool {
	for _, c := range ps.Containers {
		for _, p := range c.Ports {
			if p.Name == name {
				return true
			}
		}
	}
	return false
}

func labelsMatch(sel, labels map[string]string) bool {
	for k, v := range sel {
		if labels[k] != v {
			return false
		}
	}
	return true
}

func typedTolerations(t *testing.T, v interface{}) []corev1.Toleration {
	t.Helper()
	data, err := yaml.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	var out []corev1.Toleration
	if err := yaml.UnmarshalStrict(data, &out); err != nil {
		t.Fatal(err)
	}
	return out
}

func toInt(t *testing.T, v interface{}) int {
	t.Helper()
	n, err := strconv.Atoi(sprint(v))
	if err != nil {
		t.Fatalf("not an integer: %v", v)
	}
	return n
}
