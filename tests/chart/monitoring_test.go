package chart

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/promql/parser"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/tools/cache"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
	"github.com/harvester-csi/harvester-csi-driver/tests/chart/render"
)

const (
	dashboardFile = "dashboards/harvester-csi-driver.json"
	dashboardName = "harvester-csi-driver-dashboard"
	ruleName      = "harvester-csi-driver"
)

// scrapeLabels are the labels Prometheus adds to every series it scrapes
// through the chart's ServiceMonitor; queries may use them.
var scrapeLabels = []string{"job", "instance", "namespace", "pod", "service", "endpoint", "container"}

// series is one exported series name and the labels it carries.
type series struct {
	family string // the metric family it belongs to
	labels []string
}

// driverSeries are the series names the driver's hotplug queue exports, found
// by registering a queue's metrics in a test registry: a histogram family
// yields _bucket (with le), _sum and _count.
func driverSeries(t *testing.T) map[string]series {
	t.Helper()
	rec := &recordingRegisterer{reg: prometheus.NewRegistry()}
	informer := func(obj runtime.Object) cache.SharedIndexInformer {
		return cache.NewSharedIndexInformer(&cache.ListWatch{}, obj, 0, cache.Indexers{})
	}
	_, err := hotplug.New(hotplug.Config{Namespace: "vms"}, namedBackend("declarative"), nil,
		informer(&kubevirtv1.VirtualMachine{}), informer(&kubevirtv1.VirtualMachineInstance{}), rec)
	if err != nil {
		t.Fatalf("register the hotplug queue's metrics: %v", err)
	}
	out := map[string]series{}
	for _, c := range rec.collectors {
		ch := make(chan *prometheus.Desc, 16)
		go func() { c.Describe(ch); close(ch) }()
		for d := range ch {
			name, lbls := parseDesc(t, d)
			switch c.(type) {
			case prometheus.Histogram, *prometheus.HistogramVec:
				out[name+"_bucket"] = series{family: name, labels: append(slices.Clone(lbls), "le")}
				out[name+"_sum"] = series{family: name, labels: lbls}
				out[name+"_count"] = series{family: name, labels: lbls}
			default:
				// Counters, and the queue's own collector of per-VM gauges.
				out[name] = series{family: name, labels: lbls}
			}
		}
	}
	if len(out) < 8 {
		t.Fatalf("the hotplug queue registered only %v", out)
	}
	return out
}

// processSeries are the series every driver process exports besides the
// queue's (cmd/harvester-csi-driver/metrics.go; docs/architecture.md
// "Metrics"). That package is a main package and cannot be imported, so the
// names are listed here and checked against its source.
func processSeries(t *testing.T) map[string]series {
	t.Helper()
	out := map[string]series{
		"harvester_csi_build_info":                          {family: "harvester_csi_build_info", labels: []string{"version", "commit", "go_version"}},
		"harvester_csi_api_requests_total":                  {family: "harvester_csi_api_requests_total", labels: []string{"cluster", "verb", "code"}},
		"harvester_csi_host_token_expiry_timestamp_seconds": {family: "harvester_csi_host_token_expiry_timestamp_seconds"},
	}
	for _, h := range []string{"harvester_csi_api_request_duration_seconds"} {
		lbls := []string{"cluster", "verb"}
		out[h+"_bucket"] = series{family: h, labels: append(slices.Clone(lbls), "le")}
		out[h+"_sum"] = series{family: h, labels: lbls}
		out[h+"_count"] = series{family: h, labels: lbls}
	}
	src, err := os.ReadFile(filepath.Join(render.RepoRoot(), "cmd", "harvester-csi-driver", "metrics.go"))
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range out {
		for _, word := range append([]string{s.family}, s.labels...) {
			if word != "le" && !strings.Contains(string(src), strconv.Quote(word)) {
				t.Errorf("cmd/harvester-csi-driver/metrics.go does not name %q: the list of %s is stale", word, s.family)
			}
		}
	}
	return out
}

// sidecarSeries are the operation metrics of the CSI sidecars (attacher,
// provisioner, resizer, snapshotter), which the chart's ServiceMonitor scrapes
// from their --http-endpoint: one histogram with the driver's name, the full
// gRPC method name (`/csi.v1.Controller/ControllerPublishVolume`) and the
// gRPC status code (kubernetes-csi/csi-lib-utils v0.24.0 metrics/metrics.go,
// labelCSIDriverName, labelCSIOperationName, labelGrpcStatusCode, and
// connection/connection.go RecordMetricsClientInterceptor, which records the
// method it invokes; the attacher names the driver once it has asked it,
// external-attacher v4.12.0 cmd/csi-attacher/main.go SetDriverName). The
// `migrated` label is added only for drivers that replace an in-tree plugin,
// which this one does not.
func sidecarSeries() map[string]series {
	const h = "csi_sidecar_operations_seconds"
	lbls := []string{"driver_name", "method_name", "grpc_status_code"}
	return map[string]series{
		h + "_bucket": {family: h, labels: append(slices.Clone(lbls), "le")},
		h + "_sum":    {family: h, labels: lbls},
		h + "_count":  {family: h, labels: lbls},
	}
}

// queryableSeries are the series the chart's alerts and dashboard may query:
// the driver's, the sidecars', and Prometheus's own `up` of each target the
// ServiceMonitor scrapes.
func queryableSeries(t *testing.T) map[string]series {
	t.Helper()
	out := driverSeries(t)
	maps.Copy(out, processSeries(t))
	maps.Copy(out, sidecarSeries())
	out["up"] = series{family: "up"}
	return out
}

// checkScrapeJobs: an expression that selects `up` names the job of the
// controller's metrics Service, which is what the Prometheus Operator calls
// the targets of the chart's ServiceMonitor (the Service's name, as the
// ServiceMonitor sets no jobLabel), and the release's namespace.
func checkScrapeJobs(t *testing.T, where string, e parser.Expr, r *rendered) {
	t.Helper()
	var services []string
	for _, o := range r.ofKind("Service") {
		if o.GetLabels()["app.kubernetes.io/component"] == "metrics" && o.GetLabels()["component"] == "csi-controllers" {
			services = append(services, o.GetName())
		}
	}
	parser.Inspect(e, func(n parser.Node, _ []parser.Node) error {
		vs, ok := n.(*parser.VectorSelector)
		if !ok || vs.Name != "up" {
			return nil
		}
		var job, ns string
		for _, m := range vs.LabelMatchers {
			if m.Type != labels.MatchEqual {
				continue
			}
			switch m.Name {
			case "job":
				job = m.Value
			case "namespace":
				ns = m.Value
			}
		}
		if !slices.Contains(services, job) || ns != render.Namespace {
			t.Errorf("%s: %s selects job %q in namespace %q; the ServiceMonitor's controller targets are job %v in %q", where, vs, job, ns, services, render.Namespace)
		}
		return nil
	})
}

type namedBackend string

func (b namedBackend) Name() string { return string(b) }
func (b namedBackend) Apply(context.Context, string, []hotplug.Change) []hotplug.Outcome {
	return nil
}
func (b namedBackend) Refusal(*kubevirtv1.VirtualMachine, string) error { return nil }
func (b namedBackend) Start(context.Context, func(string)) error        { return nil }

// recordingRegisterer registers into a real registry (so the registration is
// checked) and keeps the collectors.
type recordingRegisterer struct {
	reg        *prometheus.Registry
	collectors []prometheus.Collector
}

func (r *recordingRegisterer) Register(c prometheus.Collector) error {
	if err := r.reg.Register(c); err != nil {
		return err
	}
	r.collectors = append(r.collectors, c)
	return nil
}

func (r *recordingRegisterer) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		if err := r.Register(c); err != nil {
			panic(err)
		}
	}
}

func (r *recordingRegisterer) Unregister(c prometheus.Collector) bool { return r.reg.Unregister(c) }

var descPattern = regexp.MustCompile(`^Desc\{fqName: "([a-zA-Z_:][a-zA-Z0-9_:]*)", help: "(?:[^"\\]|\\.)*", unit: "[^"]*", constLabels: \{([^}]*)\}, variableLabels: \{([^}]*)\}\}$`)

// parseDesc reads a metric's name and label names from its descriptor (the
// client library's only public view of them).
func parseDesc(t *testing.T, d *prometheus.Desc) (string, []string) {
	t.Helper()
	m := descPattern.FindStringSubmatch(d.String())
	if m == nil {
		t.Fatalf("cannot read the metric descriptor %s", d)
	}
	var lbls []string
	for _, p := range strings.Split(m[2], ",") {
		if n, _, ok := strings.Cut(p, "="); ok {
			lbls = append(lbls, n)
		}
	}
	for _, n := range strings.Split(m[3], ",") {
		if n != "" {
			lbls = append(lbls, n)
		}
	}
	return m[1], lbls
}

// labelValues are the values a query may match for the driver's labels that
// have a fixed set of them.
func labelValues() map[string][]string {
	var results []string
	for r := hotplug.Applied; r <= hotplug.Failed; r++ {
		results = append(results, r.String())
	}
	return map[string][]string{
		"result":  results,
		"op":      {hotplug.Attach.String(), hotplug.Detach.String()},
		"backend": {"declarative", "subresource"},
		// pkg/hotplug failureCause; exported at zero from the start.
		"cause":   {"refused", "unavailable", "other"},
		"cluster": {"host", "guest"},
		// The sidecars talk to this driver only.
		"driver_name": {"driver.harvesterhci.io"},
		"method_name": csiMethods,
		// google.golang.org/grpc/codes names, and csi-lib-utils' own for a
		// call that failed before reaching gRPC.
		"grpc_status_code": {"OK", "Canceled", "Unknown", "InvalidArgument", "DeadlineExceeded", "NotFound", "AlreadyExists",
			"PermissionDenied", "ResourceExhausted", "FailedPrecondition", "Aborted", "OutOfRange", "Unimplemented",
			"Internal", "Unavailable", "DataLoss", "Unauthenticated", "unknown-non-grpc"},
	}
}

// csiMethods are the CSI calls the controller sidecars make, as gRPC names.
var csiMethods = func() []string {
	var out []string
	for _, m := range []string{"Probe", "GetPluginInfo", "GetPluginCapabilities"} {
		out = append(out, "/csi.v1.Identity/"+m)
	}
	for _, m := range []string{"CreateVolume", "DeleteVolume", "ControllerPublishVolume", "ControllerUnpublishVolume",
		"ValidateVolumeCapabilities", "ListVolumes", "GetCapacity", "ControllerGetCapabilities", "CreateSnapshot",
		"DeleteSnapshot", "ListSnapshots", "ControllerExpandVolume", "ControllerGetVolume", "ControllerModifyVolume"} {
		out = append(out, "/csi.v1.Controller/"+m)
	}
	return out
}()

// checkQuery parses a PromQL expression and checks that every series it
// selects is one the driver exports, with labels and values it has. It
// returns the metric families used.
func checkQuery(t *testing.T, where, expr string, known map[string]series) []string {
	t.Helper()
	e, err := parser.ParseExpr(expr)
	if err != nil {
		t.Errorf("%s: %q is not valid PromQL: %v", where, expr, err)
		return nil
	}
	values := labelValues()
	var families []string
	selectors := 0
	parser.Inspect(e, func(n parser.Node, _ []parser.Node) error {
		vs, ok := n.(*parser.VectorSelector)
		if !ok {
			return nil
		}
		selectors++
		s, ok := known[vs.Name]
		if !ok {
			t.Errorf("%s: %s selects %q, which the driver does not export (it exports %v)", where, expr, vs.Name, sortedKeys(known))
			return nil
		}
		families = append(families, s.family)
		for _, m := range vs.LabelMatchers {
			if m.Name == labels.MetricName {
				continue
			}
			if !slices.Contains(s.labels, m.Name) && !slices.Contains(scrapeLabels, m.Name) {
				t.Errorf("%s: %s matches label %q, which %s does not have (it has %v)", where, expr, m.Name, vs.Name, s.labels)
				continue
			}
			allowed, fixed := values[m.Name]
			if !fixed || m.Value == ".*" {
				continue
			}
			var matched []string
			switch m.Type {
			case labels.MatchEqual, labels.MatchNotEqual:
				matched = []string{m.Value}
			default:
				matched = strings.Split(m.Value, "|")
			}
			for _, v := range matched {
				if !slices.Contains(allowed, v) {
					t.Errorf("%s: %s matches %s=%q, a value the driver never sets (it sets %v)", where, expr, m.Name, v, allowed)
				}
			}
		}
		return nil
	})
	if selectors == 0 {
		t.Errorf("%s: %q selects no series", where, expr)
	}
	return families
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// The parts of Grafana's dashboard model the checks read.
type grafanaDashboard struct {
	UID           string         `json:"uid"`
	Title         string         `json:"title"`
	SchemaVersion int            `json:"schemaVersion"`
	Panels        []grafanaPanel `json:"panels"`
	Templating    struct {
		List []grafanaVariable `json:"list"`
	} `json:"templating"`
}

type grafanaRef struct {
	Type string `json:"type"`
	UID  string `json:"uid"`
}

type grafanaPanel struct {
	ID         int             `json:"id"`
	Type       string          `json:"type"`
	Title      string          `json:"title"`
	Datasource *grafanaRef     `json:"datasource"`
	GridPos    *grafanaGridPos `json:"gridPos"`
	Targets    []struct {
		Datasource   *grafanaRef `json:"datasource"`
		Expr         string      `json:"expr"`
		RefID        string      `json:"refId"`
		LegendFormat string      `json:"legendFormat"`
	} `json:"targets"`
	Panels []grafanaPanel `json:"panels"` // of a collapsed row
}

type grafanaGridPos struct{ X, Y, W, H int }

type grafanaVariable struct {
	Name       string          `json:"name"`
	Type       string          `json:"type"`
	Query      json.RawMessage `json:"query"`
	Datasource *grafanaRef     `json:"datasource"`
}

// grafanaBuiltins are the variables Grafana defines itself, with a value for
// parsing the queries that use them.
var grafanaBuiltins = map[string]string{"__rate_interval": "5m", "__interval": "1m", "__range": "6h"}

var grafanaVar = regexp.MustCompile(`\$\{([a-zA-Z0-9_]+)(?::[a-z]+)?\}|\$([a-zA-Z0-9_]+)|\[\[([a-zA-Z0-9_]+)\]\]`)

// expandGrafana replaces Grafana variables in a query by values PromQL
// accepts (a range for interval variables, .* for the dashboard's own), and
// reports variables that are neither built in nor defined.
func expandGrafana(t *testing.T, where, q string, defined []string) string {
	t.Helper()
	return grafanaVar.ReplaceAllStringFunc(q, func(ref string) string {
		m := grafanaVar.FindStringSubmatch(ref)
		name := m[1] + m[2] + m[3]
		if v, ok := grafanaBuiltins[name]; ok {
			return v
		}
		if !slices.Contains(defined, name) {
			t.Errorf("%s: %q uses the variable $%s, which the dashboard does not define", where, q, name)
		}
		return ".*"
	})
}

func readDashboard(t *testing.T, data []byte) grafanaDashboard {
	t.Helper()
	var d grafanaDashboard
	if err := json.Unmarshal(data, &d); err != nil {
		t.Fatalf("%s: not JSON: %v", dashboardFile, err)
	}
	return d
}

// TestDashboardIsGrafanaJSONOverDriverMetrics: the chart's Grafana dashboard
// is a dashboard Grafana can load (uid, title, panels on the grid with
// queries), every query is PromQL over series the driver exports, with
// labels and label values it sets, and every metric the driver's queue
// exports, and the sidecars' operation metrics, have a panel.
func TestDashboardIsGrafanaJSONOverDriverMetrics(t *testing.T) {
	known := queryableSeries(t)
	required := driverSeries(t)
	maps.Copy(required, sidecarSeries())
	data, err := os.ReadFile(filepath.Join(render.ChartDir(), dashboardFile))
	if err != nil {
		t.Fatal(err)
	}
	d := readDashboard(t, data)
	if !regexp.MustCompile(`^[a-zA-Z0-9_-]{1,40}$`).MatchString(d.UID) {
		t.Errorf("uid %q: Grafana needs 1-40 letters, digits, - or _", d.UID)
	}
	if d.Title == "" || d.SchemaVersion == 0 {
		t.Errorf("title %q, schemaVersion %d: both are required", d.Title, d.SchemaVersion)
	}

	var defined, datasources []string
	for _, v := range d.Templating.List {
		defined = append(defined, v.Name)
		if v.Type == "datasource" {
			datasources = append(datasources, v.Name)
		}
	}
	if len(datasources) == 0 {
		t.Error("no datasource variable: the dashboard would be bound to one Prometheus data source name")
	}
	checkRef := func(where string, ref *grafanaRef) {
		if ref == nil {
			t.Errorf("%s: no datasource", where)
			return
		}
		name := strings.Trim(strings.TrimPrefix(ref.UID, "$"), "{}")
		if ref.Type != "prometheus" || !slices.Contains(datasources, name) {
			t.Errorf("%s: datasource %+v, want type prometheus and one of the datasource variables %v", where, *ref, datasources)
		}
	}
	used := map[string]bool{}
	for _, v := range d.Templating.List {
		if v.Type != "query" {
			continue
		}
		where := "variable $" + v.Name
		checkRef(where, v.Datasource)
		var q struct {
			Query string `json:"query"`
		}
		if err := json.Unmarshal(v.Query, &q); err != nil {
			if err := json.Unmarshal(v.Query, &q.Query); err != nil {
				t.Errorf("%s: query %s: %v", where, v.Query, err)
				continue
			}
		}
		m := regexp.MustCompile(`^label_values\((.+),\s*([a-zA-Z_][a-zA-Z0-9_]*)\)$`).FindStringSubmatch(q.Query)
		if m == nil {
			t.Errorf("%s: query %q is not label_values(<selector>, <label>)", where, q.Query)
			continue
		}
		for _, f := range checkQuery(t, where, expandGrafana(t, where, m[1], defined), known) {
			used[f] = true
		}
		if sel, err := parser.ParseMetricSelector(m[1]); err == nil {
			for _, s := range sel {
				if s.Name == labels.MetricName && !slices.Contains(known[s.Value].labels, m[2]) {
					t.Errorf("%s: %s has no label %s", where, s.Value, m[2])
				}
			}
		}
	}

	var all []grafanaPanel
	var walk func([]grafanaPanel)
	walk = func(ps []grafanaPanel) {
		for _, p := range ps {
			all = append(all, p)
			walk(p.Panels)
		}
	}
	walk(d.Panels)
	if len(all) < 8 {
		t.Fatalf("%d panels", len(all))
	}
	ids := map[int]bool{}
	type cell struct{ x, y int }
	taken := map[cell]string{}
	for _, p := range all {
		where := fmt.Sprintf("panel %d %q", p.ID, p.Title)
		if p.ID == 0 || ids[p.ID] {
			t.Errorf("%s: ids must be unique and non-zero", where)
		}
		ids[p.ID] = true
		if p.Type == "" || p.Title == "" {
			t.Errorf("%s: type and title are required", where)
		}
		if g := p.GridPos; g == nil || g.W <= 0 || g.H <= 0 || g.X < 0 || g.Y < 0 || g.X+g.W > 24 {
			t.Errorf("%s: gridPos %+v is not on Grafana's 24-column grid", where, p.GridPos)
		} else {
			for x := g.X; x < g.X+g.W; x++ {
				for y := g.Y; y < g.Y+g.H; y++ {
					if other, ok := taken[cell{x, y}]; ok {
						t.Errorf("%s overlaps %s at (%d,%d)", where, other, x, y)
						x, y = g.X+g.W, g.Y+g.H
						continue
					}
					taken[cell{x, y}] = where
				}
			}
		}
		if p.Type == "row" {
			continue
		}
		checkRef(where, p.Datasource)
		if len(p.Targets) == 0 {
			t.Errorf("%s: no queries", where)
		}
		refs := map[string]bool{}
		for _, tg := range p.Targets {
			if tg.RefID == "" || refs[tg.RefID] {
				t.Errorf("%s: refId %q must be unique and non-empty", where, tg.RefID)
			}
			refs[tg.RefID] = true
			checkRef(where+" query "+tg.RefID, tg.Datasource)
			for _, f := range checkQuery(t, where, expandGrafana(t, where, tg.Expr, defined), known) {
				used[f] = true
			}
		}
	}
	for _, s := range required {
		if !used[s.family] {
			t.Errorf("no panel shows %s: give every metric the driver exports a panel", s.family)
			used[s.family] = true
		}
	}
}

// TestMonitoringSidecarMetricsScraped: the dashboard's sidecar panels and the
// attacher alert have data: each controller sidecar serves its metrics on a
// named container port (--http-endpoint or --metrics-address), the metrics
// Service exposes that port, and the ServiceMonitor scrapes it at the
// sidecars' metrics path (csi-lib-utils' default, /metrics).
func TestMonitoringSidecarMetricsScraped(t *testing.T) {
	for _, vs := range valueSets(t) {
		r := renderSet(t, vs)
		if r.find("ServiceMonitor", ruleName) == nil {
			continue
		}
		t.Run(vs.name, func(t *testing.T) {
			sm := typed[monitoringv1.ServiceMonitor](t, r.must(t, "ServiceMonitor", ruleName))
			svc := typed[corev1.Service](t, r.must(t, "Service", controllerName+"-metrics"))
			if !labelsMatch(sm.Spec.Selector.MatchLabels, svc.Labels) {
				t.Fatalf("the ServiceMonitor (%v) does not select Service %s (%v)", sm.Spec.Selector.MatchLabels, svc.Name, svc.Labels)
			}
			pod := typed[appsv1.Deployment](t, r.must(t, "Deployment", controllerName)).Spec.Template.Spec
			for _, c := range pod.Containers {
				if !slices.Contains([]string{"csi-attacher", "csi-provisioner", "csi-resizer", "csi-snapshotter"}, c.Name) {
					continue
				}
				addr, ok := argValue(c.Args, "http-endpoint")
				if !ok {
					addr, ok = argValue(c.Args, "metrics-address")
				}
				_, port, _ := strings.Cut(addr, ":")
				var portName string
				for _, p := range c.Ports {
					if strconv.Itoa(int(p.ContainerPort)) == port {
						portName = p.Name
					}
				}
				if !ok || portName == "" {
					t.Errorf("%s serves no metrics on a named port (--http-endpoint %q, ports %v)", c.Name, addr, c.Ports)
					continue
				}
				onService := slices.ContainsFunc(svc.Spec.Ports, func(p corev1.ServicePort) bool { return p.TargetPort.String() == portName })
				scraped := slices.ContainsFunc(sm.Spec.Endpoints, func(ep monitoringv1.Endpoint) bool {
					return ep.Port == portName && (ep.Path == "" || ep.Path == "/metrics")
				})
				if !onService || !scraped {
					t.Errorf("%s's metrics port %s: on Service %s %v, scraped by the ServiceMonitor %v", c.Name, portName, svc.Name, onService, scraped)
				}
			}
		})
	}
}

// TestMonitoringObjects: the dashboard ConfigMap and the PrometheusRule render
// when enabled (and metrics are on), with their namespace, labels and the
// dashboard file as it is in the chart; neither renders otherwise.
func TestMonitoringObjects(t *testing.T) {
	data, err := os.ReadFile(filepath.Join(render.ChartDir(), dashboardFile))
	if err != nil {
		t.Fatal(err)
	}
	check := func(t *testing.T, r *rendered) {
		metricsOn := nested(t, r.eff, "metrics", "enabled").(bool)
		dash := nested(t, r.eff, "metrics", "dashboard").(map[string]interface{})
		wantDash := metricsOn && dash["enabled"].(bool)
		if got := r.find("ConfigMap", dashboardName) != nil; got != wantDash {
			t.Errorf("dashboard ConfigMap rendered: %v, want %v (metrics.enabled=%v, metrics.dashboard.enabled=%v)", got, wantDash, metricsOn, dash["enabled"])
		}
		if wantDash {
			cm := typed[corev1.ConfigMap](t, r.must(t, "ConfigMap", dashboardName))
			if want := sprint(dash["namespace"]); want != "" && cm.Namespace != want || want == "" && cm.Namespace != render.Namespace {
				t.Errorf("dashboard ConfigMap namespace %q, metrics.dashboard.namespace %q", cm.Namespace, want)
			}
			if got := cm.Labels[sprint(dash["label"])]; got != sprint(dash["labelValue"]) {
				t.Errorf("dashboard ConfigMap label %s=%q, want %q (the sidecar's selector)", dash["label"], got, dash["labelValue"])
			}
			for k, v := range dash["labels"].(map[string]interface{}) {
				if cm.Labels[k] != sprint(v) {
					t.Errorf("dashboard ConfigMap lacks label %s=%v", k, v)
				}
			}
			for k, v := range dash["annotations"].(map[string]interface{}) {
				if cm.Annotations[k] != sprint(v) {
					t.Errorf("dashboard ConfigMap lacks annotation %s=%v", k, v)
				}
			}
			if got := cm.Data[filepath.Base(dashboardFile)]; strings.TrimSpace(got) != strings.TrimSpace(string(data)) {
				t.Errorf("dashboard ConfigMap data %v does not hold %s as it is", sortedKeys(cm.Data), dashboardFile)
			}
		}
		pr := nested(t, r.eff, "metrics", "prometheusRule").(map[string]interface{})
		wantRule := metricsOn && pr["enabled"].(bool)
		if got := r.find("PrometheusRule", ruleName) != nil; got != wantRule {
			t.Errorf("PrometheusRule rendered: %v, want %v (metrics.enabled=%v, metrics.prometheusRule.enabled=%v)", got, wantRule, metricsOn, pr["enabled"])
		}
		if wantRule {
			rule := typed[monitoringv1.PrometheusRule](t, r.must(t, "PrometheusRule", ruleName))
			if want := sprint(pr["namespace"]); want != "" && rule.Namespace != want || want == "" && rule.Namespace != render.Namespace {
				t.Errorf("PrometheusRule namespace %q, metrics.prometheusRule.namespace %q", rule.Namespace, want)
			}
			for k, v := range pr["labels"].(map[string]interface{}) {
				if rule.Labels[k] != sprint(v) {
					t.Errorf("PrometheusRule lacks label %s=%v", k, v)
				}
			}
		}
	}
	for _, vs := range valueSets(t) {
		t.Run(vs.name, func(t *testing.T) { check(t, renderSet(t, vs)) })
	}
	on := map[string]interface{}{"metrics": map[string]interface{}{
		"dashboard":      map[string]interface{}{"enabled": true},
		"prometheusRule": map[string]interface{}{"enabled": true},
	}}
	t.Run("enabled", func(t *testing.T) {
		r := renderVals(t, on)
		r.must(t, "ConfigMap", dashboardName)
		r.must(t, "PrometheusRule", ruleName)
		check(t, r)
		notes, err := render.Notes(loadChart(t), on)
		if err != nil {
			t.Fatal(err)
		}
		for _, want := range []string{"ConfigMap " + render.Namespace + "/" + dashboardName, "PrometheusRule " + render.Namespace + "/" + ruleName} {
			if !strings.Contains(notes, want) {
				t.Errorf("NOTES.txt does not name %s:\n%s", want, notes)
			}
		}
	})
	t.Run("enabled-without-metrics", func(t *testing.T) {
		off := map[string]interface{}{"metrics": map[string]interface{}{
			"enabled":        false,
			"dashboard":      map[string]interface{}{"enabled": true},
			"prometheusRule": map[string]interface{}{"enabled": true},
		}}
		r := renderVals(t, off)
		check(t, r)
	})
	t.Run("values-of-a-chart-without-them", func(t *testing.T) {
		// `helm upgrade --reuse-values` from a chart version that had
		// neither key: nothing renders, nothing fails.
		r := renderVals(t, map[string]interface{}{"metrics": map[string]interface{}{"dashboard": nil, "prometheusRule": nil}})
		if r.find("ConfigMap", dashboardName) != nil || r.find("PrometheusRule", ruleName) != nil {
			t.Errorf("rendered %v", r.names())
		}
	})
	t.Run("dashboard-in-the-custom-values", func(t *testing.T) {
		// The value sets must exercise both objects, or the checks above and
		// the API-server dry-run never see them.
		seen := map[string]bool{}
		for _, vs := range valueSets(t) {
			r := renderSet(t, vs)
			seen["ConfigMap"] = seen["ConfigMap"] || r.find("ConfigMap", dashboardName) != nil
			seen["PrometheusRule"] = seen["PrometheusRule"] || r.find("PrometheusRule", ruleName) != nil
		}
		if !seen["ConfigMap"] || !seen["PrometheusRule"] {
			t.Errorf("no ci/*-values.yaml renders the dashboard and the PrometheusRule: %v", seen)
		}
	})
}

// alertSpec is how each alert is configured in values.yaml: its key under
// metrics.prometheusRule.rules, the values its expression compares with
// (key -> the factor from the value to the query's unit), and the
// troubleshooting section it links.
type alertSpec struct {
	key, anchor string
	thresholds  map[string]float64
	perVM       bool // the alert names a VM
}

var alertSpecs = map[string]alertSpec{
	"HarvesterCSIHotplugQueueNotDraining":  {key: "queueNotDraining", anchor: "queue-not-draining", perVM: true},
	"HarvesterCSIHotplugIntentWaitingLong": {key: "intentWaitingLong", thresholds: map[string]float64{"seconds": 1}, anchor: "intent-waiting-long", perVM: true},
	"HarvesterCSIHotplugVolumesRejected":   {key: "rejectedVolumes", thresholds: map[string]float64{"count": 1}, anchor: "rejected-volumes"},
	"HarvesterCSIHotplugVMWedged":          {key: "vmWedged", anchor: "a-vm-wedged-in-kubevirt"},
	"HarvesterCSIHotplugHostErrors":        {key: "hostErrors", thresholds: map[string]float64{"failures": 1}, anchor: "host-refuses"},
	"HarvesterCSIHostCredentialsRefused":   {key: "hostCredentialsRefused", anchor: "host-credentials-refused"},
	"HarvesterCSIHostTokenExpiring":        {key: "hostTokenExpiry", thresholds: map[string]float64{"days": 86400}, anchor: "host-token-expiring"},
	"HarvesterCSIMetricsTargetDown":        {key: "targetDown", anchor: "metrics-target-down"},
	"HarvesterCSIAttacherPublishErrors":    {key: "attacherPublishErrors", thresholds: map[string]float64{"count": 1, "ratio": 1}, anchor: "attacher-publish-errors"},
}

func renderedRules(t *testing.T, r *rendered) []monitoringv1.Rule {
	t.Helper()
	pr := typed[monitoringv1.PrometheusRule](t, r.must(t, "PrometheusRule", ruleName))
	var out []monitoringv1.Rule
	for _, g := range pr.Spec.Groups {
		out = append(out, g.Rules...)
	}
	return out
}

// TestPrometheusRuleAlerts: each alert is valid PromQL over series the driver
// exports, takes its threshold, window, duration and severity from the
// values, and links its section of docs/troubleshooting.md.
func TestPrometheusRuleAlerts(t *testing.T) {
	known := queryableSeries(t)
	sets := []valueSet{}
	for _, vs := range valueSets(t) {
		if r := renderSet(t, vs); r.find("PrometheusRule", ruleName) != nil {
			sets = append(sets, vs)
		}
	}
	if len(sets) == 0 {
		t.Fatal("no value set renders the PrometheusRule")
	}
	for _, vs := range sets {
		t.Run(vs.name, func(t *testing.T) {
			r := renderSet(t, vs)
			pr := nested(t, r.eff, "metrics", "prometheusRule").(map[string]interface{})
			base := sprint(pr["runbookURL"])
			if base == "" {
				base = loadChart(t).Metadata.Home + "/blob/main/docs/troubleshooting.md"
			}
			seen := map[string]bool{}
			for _, rule := range renderedRules(t, r) {
				spec, ok := alertSpecs[rule.Alert]
				if !ok {
					t.Errorf("alert %q is not one this test knows: add it to alertSpecs", rule.Alert)
					continue
				}
				seen[rule.Alert] = true
				vals := nested(t, r.eff, "metrics", "prometheusRule", "rules", spec.key).(map[string]interface{})
				where := "alert " + rule.Alert
				expr := rule.Expr.String()
				checkQuery(t, where, expr, known)
				e, err := parser.ParseExpr(expr)
				if err != nil {
					continue
				}
				// Each threshold is the right side of a comparison in the
				// expression (`<query> > <threshold>`, or `<` for a bound below).
				var bounds []float64
				parser.Inspect(e, func(n parser.Node, _ []parser.Node) error {
					if b, ok := n.(*parser.BinaryExpr); ok && (b.Op == parser.GTR || b.Op == parser.LSS) {
						if num, ok := b.RHS.(*parser.NumberLiteral); ok {
							bounds = append(bounds, num.Val)
						}
					}
					return nil
				})
				for key, scale := range spec.thresholds {
					v, err := strconv.ParseFloat(sprint(vals[key]), 64)
					if err != nil {
						t.Errorf("%s: rules.%s.%s is %v: %v", where, spec.key, key, vals[key], err)
					} else if !slices.Contains(bounds, v*scale) {
						t.Errorf("%s: %q compares with none of %v as rules.%s.%s (%v) asks", where, expr, v*scale, spec.key, key, vals[key])
					}
				}
				checkScrapeJobs(t, where, e, r)
				if w, ok := vals["window"]; ok {
					want, err := model.ParseDuration(sprint(w))
					if err != nil {
						t.Fatalf("rules.%s.window %v: %v", spec.key, w, err)
					}
					ranges := 0
					parser.Inspect(e, func(n parser.Node, _ []parser.Node) error {
						if m, ok := n.(*parser.MatrixSelector); ok {
							ranges++
							if m.Range != time.Duration(want) {
								t.Errorf("%s: range %v, rules.%s.window is %v", where, m.Range, spec.key, w)
							}
						}
						return nil
					})
					if ranges == 0 {
						t.Errorf("%s: rules.%s.window is set but the expression has no range", where, spec.key)
					}
				}
				if rule.For == nil {
					t.Errorf("%s: no `for`", where)
				} else if got, err := model.ParseDuration(string(*rule.For)); err != nil {
					t.Errorf("%s: for %q: %v", where, *rule.For, err)
				} else if want, _ := model.ParseDuration(sprint(vals["for"])); got != want {
					t.Errorf("%s: for %v, rules.%s.for is %v", where, got, spec.key, vals["for"])
				}
				if rule.Labels["severity"] != sprint(vals["severity"]) {
					t.Errorf("%s: severity %q, rules.%s.severity is %v", where, rule.Labels["severity"], spec.key, vals["severity"])
				}
				for k, v := range pr["alertLabels"].(map[string]interface{}) {
					if rule.Labels[k] != sprint(v) {
						t.Errorf("%s: lacks alert label %s=%v", where, k, v)
					}
				}
				if rule.Annotations["summary"] == "" || rule.Annotations["description"] == "" {
					t.Errorf("%s: summary and description are required", where)
				}
				if want := base + "#" + spec.anchor; rule.Annotations["runbook_url"] != want {
					t.Errorf("%s: runbook_url %q, want %q", where, rule.Annotations["runbook_url"], want)
				}
				if spec.perVM != strings.Contains(rule.Annotations["description"], "$labels.vm") {
					t.Errorf("%s: the description should name the VM exactly when the alert is per VM (%v)", where, spec.perVM)
				}
			}
			for name, spec := range alertSpecs {
				enabled := nested(t, r.eff, "metrics", "prometheusRule", "rules", spec.key, "enabled").(bool)
				if enabled != seen[name] {
					t.Errorf("alert %s rendered: %v, rules.%s.enabled is %v", name, seen[name], spec.key, enabled)
				}
			}
		})
	}
	t.Run("each-alert-switches-off", func(t *testing.T) {
		for name, spec := range alertSpecs {
			r := renderVals(t, map[string]interface{}{"metrics": map[string]interface{}{"prometheusRule": map[string]interface{}{
				"enabled": true, "rules": map[string]interface{}{spec.key: map[string]interface{}{"enabled": false}},
			}}})
			var names []string
			for _, rule := range renderedRules(t, r) {
				names = append(names, rule.Alert)
			}
			if slices.Contains(names, name) || len(names) != len(alertSpecs)-1 {
				t.Errorf("rules.%s.enabled=false renders %v", spec.key, names)
			}
		}
	})
}

// TestRunbookAnchorsExist: the sections the alerts link are in
// docs/troubleshooting.md (as GitHub makes anchors of headings, or as explicit
// ids).
func TestRunbookAnchorsExist(t *testing.T) {
	data, err := os.ReadFile(filepath.Join(render.RepoRoot(), "docs", "troubleshooting.md"))
	if err != nil {
		t.Fatal(err)
	}
	anchors := map[string]bool{}
	for _, line := range strings.Split(string(data), "\n") {
		if h, ok := strings.CutPrefix(line, "#"); ok {
			anchors[githubAnchor(strings.TrimLeft(h, "# "))] = true
		}
	}
	for _, m := range regexp.MustCompile(`(?:id|name)="([^"]+)"`).FindAllStringSubmatch(string(data), -1) {
		anchors[m[1]] = true
	}
	for name, spec := range alertSpecs {
		if !anchors[spec.anchor] {
			t.Errorf("alert %s links docs/troubleshooting.md#%s, which has no such section", name, spec.anchor)
		}
	}
}

// githubAnchor is the anchor GitHub gives a markdown heading.
func githubAnchor(heading string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(strings.TrimSpace(heading)) {
		switch {
		case r == ' ' || r == '-':
			b.WriteRune('-')
		case r == '_' || r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r > 127:
			b.WriteRune(r)
		}
	}
	return b.String()
}
